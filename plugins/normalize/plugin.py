"""Plugin `normalize`: move per-request values out of the prompt head, so prefixes repeat.

A timestamp or request id near the top of a system prompt makes every request's prefix
unique, and no prefix cache ever hits. This plugin finds such values in the system messages
(and optionally the first N messages), takes each out of where it stands and appends it, with
the label that introduced it, in one short block at the tail. Chat bodies and Anthropic
Messages bodies (`/v1/messages`: `system` as a string or text blocks, content blocks; only
text is rewritten, never `tool_use` inputs or `tool_result` contents) alike:

    system: "当前时间是 2026-03-15 14:22:31，请根据以下规则回答…"
      →     "请根据以下规则回答…"
    last user message: "… question\\n\\n<dynamic_context>\\n当前时间：2026-03-15 14:22:31\\n"
                       "</dynamic_context>"

When a label and its value form a line or sentence of their own, the whole clause moves;
otherwise only the value is replaced by a numbered placeholder (`⟨1⟩`) that the tail block
resolves. Two requests that differ only in dynamic values are then byte-identical up to the
tail, and the model still reads every value exactly once. Detection is typed and labelled
(`detectors.py`; its vocabulary is `labels.py`), skipping what a prompt only mentions (few-shot
examples, quotations, code: `mentions.py`), plus learned from variation across requests
(`learner.py`), per model: each
model (`ctx.model`) has its own Learner — a template learned from one model's traffic never
moves anything in another's — while the detectors and the analysis cache are shared.
"""
from __future__ import annotations

import json
from dataclasses import replace

import xxhash
from prometheus_client import CollectorRegistry, Counter, Gauge

from prefixgate.common.anthropic_messages import BILLING_HEADER
from prefixgate.common.schema import ConfigError, Key, non_negative, one_of, positive
from prefixgate.plugins.normalize.detectors import (
    BARE,
    TYPES,
    Detector,
    Found,
    _inside_sorted,
    code_spans,
    context_label,
    scan,
    word_start,
)
from prefixgate.plugins.normalize.learner import Learner, template_key
from prefixgate.plugins.normalize.mentions import drop_mentions
from prefixgate.plugins.normalize.suffix_reuse import reuse
from prefixgate.proxy.lru import LRU
from prefixgate.proxy.plugin import Plugin

REUSE_MIN_CHARS = 4096      # shorter texts are scanned whole: reuse would not pay
REUSE_KEY_CHARS = 256       # texts ending in the same 256 chars are tried for reuse
REUSE_TEXTS = 32            # recent texts kept for reuse (each holds its text and analysis)
MAX_MODELS = 64             # models with a Learner of their own (least recently used dropped)

OPEN, CLOSE = "<dynamic_context>", "</dynamic_context>"
MESSAGES_PATH = "/v1/messages"       # and /v1/messages/count_tokens: Anthropic Messages bodies
_JOIN_GAP = frozenset(" \tT,，/-:：年月日时分秒")    # between two varying slots of one value


def _list_of(allowed):
    def _check(v):
        bad = [x for x in v if x not in allowed]
        return f"unknown {bad[0]!r} (allowed: {', '.join(allowed)})" if bad else None
    return _check


def _strings(v):
    return None if all(isinstance(x, str) and x.strip() for x in v) else "must be non-empty strings"


SPEC = {
    "roles": Key(list, lambda: ["system", "developer"], _strings),  # messages scanned by role
    "scan_first": Key(int, 0, non_negative),          # ... and the first N messages of any role
    "move_to": Key(str, "last_user", one_of("last_user", "system_tail")),
    "detectors": Key(list, lambda: list(TYPES), _list_of(TYPES)),
    "bare": Key(list, lambda: sorted(BARE), _list_of(tuple(BARE))),  # types moved without label
    "labels": Key(dict, dict, nested={"time": Key(list, list, _strings),
                                      "id": Key(list, list, _strings)}),
    "rules": Key(list, list),                          # [{pattern, label}] custom regexes
    "learn": Key(bool, True),
    "learn_after": Key(int, 3, lambda v: None if v >= 2 else "must be >= 2"),
    "learn_templates": Key(int, 256, positive),      # memory: at most templates x slots
    "learn_max_slots": Key(int, 2048, positive),     # remembered values (~30 MB worst case)
    "max_moves": Key(int, 32, positive),
    "cache_texts": Key(int, 256, non_negative),       # analyses of recently seen texts
    "canonical_tools": Key(bool, False),
    "max_chars": Key(int, 262144, positive),          # longer texts are left alone: the hot
}                                                     # path stays bounded (~10 ms at most)


def compile_rules(rules: list) -> list:
    import re
    out = []
    for i, r in enumerate(rules):
        if not isinstance(r, dict) or not isinstance(r.get("pattern"), str):
            raise ConfigError(f"rules[{i}]", "must be a mapping with a string `pattern`")
        unknown = set(r) - {"pattern", "label"}
        if unknown:
            raise ConfigError(f"rules[{i}].{sorted(unknown)[0]}",
                              "unknown key (allowed: label, pattern)")
        try:
            rx = re.compile(r["pattern"])
        except re.error as e:
            raise ConfigError(f"rules[{i}].pattern", f"invalid regex: {e}") from None
        if rx.search(""):
            raise ConfigError(f"rules[{i}].pattern", "must not match the empty string")
        out.append((rx, r.get("label") or ""))
    return out


class _Analysis:
    """What a text contains, independent of other requests (cached by the text's hash)."""
    __slots__ = ("toks", "values", "code", "found", "key")

    def __init__(self, toks, values, code, found, key):
        self.toks, self.values, self.code, self.found, self.key = toks, values, code, found, key


class Normalizer:
    """The pure part: rewrites a chat body in place and says what moved."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.detector = Detector(cfg["detectors"], cfg["bare"], cfg["labels"]["time"],
                                 cfg["labels"]["id"], compile_rules(cfg["rules"]))
        self.learn = bool(cfg["learn"])
        # one Learner per model seen (key: ctx.model, None for a request naming none)
        self.learners: LRU[str | None, Learner] = LRU(MAX_MODELS)
        self.roles = frozenset(cfg["roles"])
        self.cache: LRU[int, _Analysis] = LRU(cfg["cache_texts"])
        self.seen_once: LRU[int, None] = LRU(4 * cfg["cache_texts"])   # text hashes, no analysis
        self.recent: LRU[int, tuple] = LRU(REUSE_TEXTS)                  # by ending: suffix_reuse

    @property
    def learner(self) -> Learner | None:
        """The Learner of requests naming no model (None when learning is off)."""
        return self.learner_for(None)

    def learner_for(self, model: str | None) -> Learner | None:
        """`model`'s Learner, made on first use (None when learning is off)."""
        if not self.learn:
            return None
        learner = self.learners.get(model)
        if learner is None:
            cfg = self.cfg
            learner = Learner(cfg["learn_after"], cfg["learn_templates"], cfg["learn_max_slots"])
            self.learners.put(model, learner)
        return learner

    def learned_templates(self) -> int:
        """Templates remembered, over every model's Learner."""
        return sum(len(learner.templates) for learner in self.learners.values())

    # --- one text ------------------------------------------------------------------------------
    def analyze(self, text: str) -> _Analysis:
        h = xxhash.xxh3_128_intdigest(text.encode("utf-8", "surrogatepass"))
        a = self.cache.get(h)
        if a is not None:
            return a
        code = code_spans(text)
        toks, statics, values, candidates = self._scan(text, code)
        # mentions look back further than suffix_reuse guarantees: dropped over the whole text
        found = drop_mentions(text, candidates, self.cfg["max_moves"])
        key = template_key(statics) if self.learn and toks else 0
        a = _Analysis(toks, values, code, found, key)
        if self.cfg["cache_texts"]:
            # cache a text the second time it is seen: one carrying a fresh timestamp never
            # repeats, and caching it would only evict the static prompts that do
            if h in self.seen_once:
                del self.seen_once[h]
                self.cache.put(h, a)
            else:
                self.seen_once.put(h, None)
        return a

    def _scan(self, text: str, code):
        """Tokens, static pieces, values and typed candidates: from a recent text with the same
        ending when one shares enough (`suffix_reuse`), else from scratch."""
        if len(text) < REUSE_MIN_CHARS or self.detector.rules:
            toks, statics, values = scan(text)
            return toks, statics, values, self.detector.candidates(text, toks, code)
        sk = hash(text[-REUSE_KEY_CHARS:])
        prev = self.recent.peek(sk)
        got = reuse(text, code, *prev, self.detector) if prev is not None else None
        if got is None:
            toks, statics, values = scan(text)
            got = toks, statics, values, self.detector.candidates(text, toks, code)
        self.recent.put(sk, (text, *got[:3], got[3], code))
        return got

    def plan(self, text: str, learner: Learner | None = None) -> list[Found]:
        """Everything to move from `text`: typed finds, then the slots `learner` (the
        request's model's) has learned, where the finds do not cover them."""
        a = self.analyze(text)
        if learner is None or not a.toks:
            return a.found
        learned = learner.observe(a.key, a.values)
        if not learned:
            return a.found
        return _merge(a.found, _learned_finds(text, a.toks, learned, a.code))

    # --- a whole body -------------------------------------------------------------------------
    def normalize(self, body: dict, model: str | None = None, messages_api: bool = False
                  ) -> list[dict]:
        """Rewrite `body` in place; return one record per moved value (empty: untouched).
        `model` (the request's, after aliases) picks whose learned templates apply.
        `messages_api`: `body` is an Anthropic Messages request (`system` at the top level,
        content as blocks); else a chat request."""
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return []
        if messages_api:
            if _messages_done(body):
                return []
            texts = [("system", holder, field) for holder, field in _system_fields(body)]
        else:
            if _already_done(msgs):
                return []
            texts = []
        roles, first = self.roles, self.cfg["scan_first"]
        for i, msg in enumerate(msgs):          # by role, or among the first `scan_first`
            if isinstance(msg, dict) and (msg.get("role") in roles or (
                    i < first and msg.get("role") in ("user", "assistant"))):
                texts += [(i, holder, field) for holder, field in _text_fields(msg)]
        learner = self.learner_for(model)
        moved, lines, numbers = [], [], {}
        budget, number = self.cfg["max_moves"], 1     # number: the next placeholder's
        for where, holder, field in texts:
            text = holder[field]
            if len(text) > self.cfg["max_chars"]:
                continue
            found = self.plan(text, learner)[:budget - len(moved)]
            if not found:
                continue
            new, new_lines, next_no = rewrite(text, found, number, numbers)
            if messages_api and not new.strip():
                # the whole text moved: Messages refuses an empty text block, so the values
                # leave placeholders and their labels stay
                new, new_lines, next_no = rewrite(text, [replace(f, cut=None) for f in found],
                                                  number, numbers)
            holder[field], number = new, next_no
            lines += new_lines
            moved += [{"message": where, "label": f.label, "value": f.value, "type": f.type}
                      for f in found]
            if len(moved) >= budget:
                break
        if moved:
            block = "\n".join(lines)
            if messages_api:
                attach_messages(body, block, self.cfg["move_to"])
            else:
                attach(msgs, block, self.cfg["move_to"])
        return moved


def _learned_finds(text: str, toks, learned: frozenset[int], code) -> list[Found]:
    """Learned slots as finds (never inside code); neighbouring varying slots of one value
    become one find."""
    out: list[Found] = []
    for i in sorted(learned):
        s, e = toks[i]
        if code and _inside_sorted(code, s):
            continue
        s = word_start(text, s)
        if out and out[-1].end <= s and s - out[-1].end <= 3 and all(
                c in _JOIN_GAP for c in text[out[-1].end:s]):
            last = out[-1]
            last.end, last.value = e, text[last.start:e]
            continue
        out.append(Found(s, e, text[s:e], context_label(text, s), "learned"))
    return out


def _merge(typed: list[Found], learned: list[Found]) -> list[Found]:
    out, end = [], -1
    for f in sorted(typed + learned, key=lambda f: (f.start, f.type == "learned")):
        if f.start >= end:
            out.append(f)
            end = f.end
        elif f.type != "learned" and out and out[-1].type == "learned":
            out[-1] = f               # a typed find wins over a learned slot inside it
            end = f.end
    return out


def rewrite(text: str, found: list[Found], first_no: int, numbers: dict | None = None
            ) -> tuple[str, list[str], int]:
    """Cut or replace each find; return the new text, the tail lines (in text order) and the
    next placeholder number. `numbers` (value -> its placeholder number, over one request)
    gives a value that stood in several places one placeholder and one tail line."""
    parts, lines, prev, no = [], [], 0, first_no
    numbers = {} if numbers is None else numbers
    for f in found:
        label = f.label.strip()
        sep = "：" if any(ord(c) > 0x2E80 for c in label) else ": "
        if "\n" in f.value:                 # a block ("Status:\nM a.py\n?? b.py")
            sep = sep.rstrip() + "\n"
        if f.cut is not None and f.cut[0] >= prev:
            parts.append(text[prev:f.cut[0]])
            prev = f.cut[1]
            lines.append(f"{label}{sep}{f.value}")
            continue
        start = max(f.start, prev)
        parts.append(text[prev:start])
        prev = f.end
        known = numbers.get(f.value)
        if known is not None:
            parts.append(f"⟨{known}⟩")
            continue
        parts.append(f"⟨{no}⟩")
        numbers[f.value] = no
        lines.append(f"⟨{no}⟩ {label}{sep}{f.value}" if label else f"⟨{no}⟩{sep}{f.value}")
        no += 1
    parts.append(text[prev:])
    return "".join(parts), lines, no


def attach(msgs: list, lines: str, move_to: str) -> None:
    """Append the tail block to the last user message, or as a final system message."""
    block = f"{OPEN}\n{lines}\n{CLOSE}"
    if move_to == "last_user":
        for msg in reversed(msgs):
            if isinstance(msg, dict) and msg.get("role") == "user":
                content = msg.get("content")
                if isinstance(content, str):
                    msg["content"] = f"{content}\n\n{block}" if content else block
                    return
                if isinstance(content, list):
                    content.append({"type": "text", "text": block})
                    return
                break
    msgs.append({"role": "system", "content": block})


def attach_messages(body: dict, lines: str, move_to: str) -> None:
    """The tail block of a Messages request: appended to the last user message (to its last
    block when that is text, else as a text block after its `tool_result` blocks, which must
    come first), or to `system` with `move_to: system_tail` (Messages has no system role in
    `messages`), or when no user message can take it."""
    block = f"{OPEN}\n{lines}\n{CLOSE}"
    if move_to == "last_user":
        msg = next((m for m in reversed(body["messages"]) if isinstance(m, dict)
                    and m.get("role") == "user"), None)
        content = msg.get("content") if msg is not None else None
        if isinstance(content, str):
            msg["content"] = f"{content}\n\n{block}" if content else block
            return
        if isinstance(content, list):
            last = content[-1] if content else None
            if isinstance(last, dict) and last.get("type") == "text" and isinstance(
                    last.get("text"), str):
                last["text"] = f"{last['text']}\n\n{block}" if last["text"] else block
            else:
                content.append({"type": "text", "text": block})
            return
    system = body.get("system")
    if isinstance(system, list):
        system.append({"type": "text", "text": block})
    else:
        body["system"] = f"{system}\n\n{block}" if isinstance(system, str) and system else block


def _system_fields(body: dict):
    """(holder, key) pairs for each text of a Messages request's `system`: the string, or each
    text block (its other keys, `cache_control` included, stay as they are). Claude Code's
    per-request attribution block (`x-anthropic-billing-header: …`) is passed over: vLLM drops
    it before rendering (`common/anthropic_messages.py`), so it never reaches the prompt."""
    system = body.get("system")
    if isinstance(system, str):
        if system and not system.startswith(BILLING_HEADER):
            yield body, "system"
    elif isinstance(system, list):
        for block in system:
            if isinstance(block, dict) and block.get("type") == "text" and isinstance(
                    block.get("text"), str) and not block["text"].startswith(BILLING_HEADER):
                yield block, "text"


def _messages_done(body: dict) -> bool:
    """A Messages request that carries a tail block already (idempotence)."""
    return any(holder[field].endswith(CLOSE) for holder, field in _system_fields(body)) \
        or _already_done(body["messages"])


def _text_fields(msg: dict):
    """(holder, key) pairs for each text in a message: a string content or text parts."""
    content = msg.get("content")
    if isinstance(content, str):
        if content:
            yield msg, "content"
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(
                    part.get("text"), str):
                yield part, "text"


def _already_done(msgs: list) -> bool:
    """A tail block is present: this body was normalised before (idempotence)."""
    last_user = next((m for m in reversed(msgs) if isinstance(m, dict)
                      and m.get("role") == "user"), None)
    for msg in (msgs[-1], last_user):
        if isinstance(msg, dict):
            for holder, field in _text_fields(msg):
                if holder[field].endswith(CLOSE):
                    return True
    return False


def canonical_tools(tools: list) -> list:
    """Tools with keys sorted at every level and the list sorted by name, so equal sets of
    tools serialise equally whatever order the client built them in."""
    canon = json.loads(json.dumps(tools, sort_keys=True))
    return sorted(canon, key=lambda t: json.dumps(t.get("function", t), sort_keys=True)
                  if isinstance(t, dict) else "")


class Normalize(Plugin):
    name = "normalize"
    spec = SPEC

    def __init__(self, cfg, gw):
        super().__init__(cfg, gw)
        self.core = Normalizer(self.cfg)
        reg = getattr(gw, "registry", None) or CollectorRegistry()
        self.requests = Counter("prefixgate_normalize_requests", "Requests seen by normalize, "
                                "by result (moved, unchanged, opted_out)", ["result"], registry=reg)
        self.moved = Counter("prefixgate_normalize_moved_values", "Values moved to the tail, "
                             "by detector type", ["type"], registry=reg)
        self.templates = Gauge("prefixgate_normalize_learned_templates", "Prompt templates "
                               "the learned detector remembers", registry=reg)

    async def on_request(self, ctx) -> None:
        if ctx.headers.get("x-prefixgate-normalize", "").strip().lower() == "off":
            self.requests.labels("opted_out").inc()
            return
        body = ctx.body
        if self.cfg["canonical_tools"] and isinstance(body.get("tools"), list):
            canon = canonical_tools(body["tools"])
            if json.dumps(canon) != json.dumps(body["tools"]):
                body["tools"] = canon
                ctx.body_changed = True
        moved = self.core.normalize(body, ctx.model, ctx.path.startswith(MESSAGES_PATH))
        ctx.normalized = True
        ctx.response_headers["x-prefixgate-moved"] = str(len(moved))
        if not moved:
            self.requests.labels("unchanged").inc()
            return
        ctx.body_changed = True
        ctx.moved.extend(moved)
        self.requests.labels("moved").inc()
        for m in moved:
            self.moved.labels(m["type"]).inc()
        if self.core.learn:
            self.templates.set(self.core.learned_templates())
