"""Typed detectors for per-request values in prompt text (dates, times, ids, tokens).

Precision first: a value is reported only when

* a label right before it marks it as current / per-request ("Current time:", "当前时间是",
  "Request ID:", "requestId=", "订单号"; the vocabulary is `labels.py`), and the value has a
  type that fits the label (a time label takes a date, time or epoch — a freshness label
  only one with a time of day; an id label takes a UUID, ULID, JWT, random token or an
  id-like word that is not a count: "Session ID is 128 bits"), or
* it is *bare* but of a type that is per-request by nature (UUID, ULID, JWT, an API's
  prefixed id such as `msg_01XF…`, `toolu_…`, `chatcmpl-…`; configurable), or
* it is an *environment field* a coding agent puts near the head of its prompt ("Working
  directory: /Users/me/app", "Current branch: feat/x", "Platform: darwin", `<cwd>…</cwd>`, a
  "Status:" line with `git status --short` lines below it) and the value has the field's
  shape (a path, a ref name, an OS, a shell, a time zone, status or commit lines),

and the text does not merely mention it: values in few-shot examples, illustrations,
quotations and code-like calls stay (`mentions.py`). Everything else — versions, prices,
phone numbers, IPs, hex colours, commit hashes, fixed dates ("last updated 2023-11-05") —
has no such label and stays. Text inside code blocks, inline code and embedded tool
definitions is never looked at.

Cost: almost every value we look for contains an ASCII digit, so one C-level regex pass finds
the digit-bearing tokens and all per-token work (label check, type check) runs only on those.
The rest are found from single-character literals the regex engine skips to at C speed: a
newline (environment fields start a line), `/` (a path in running text), `_` and `-` (an id
with no digit: "t_aefdfeea"), each then checked against its label.
"""
from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate

from prefixgate.plugins.normalize import labels, mentions

TYPES = ("datetime", "epoch", "uuid", "ulid", "jwt", "token", "id", "prefixed", "env")

WINDOW = 72          # chars before a token searched for its label

# --- value grammars ---------------------------------------------------------------------------
_MON = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
        r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")
_DOW = (r"(?:Mon(?:day)?|Tue(?:s(?:day)?)?|Wed(?:nesday)?|Thu(?:r(?:s(?:day)?)?)?|Fri(?:day)?"
        r"|Sat(?:urday)?|Sun(?:day)?)")
_TZ = (r"(?:\s?(?:Z|[+-][0-9]{2}:?[0-9]{2}|(?:UTC|GMT)(?:\s?[+-][0-9]{1,2}(?::?[0-9]{2})?)?"
       r"|[ECMP][SD]?T|CES?T|BST|IST|JST|KST|AES?T)(?![A-Za-z])"
       r"|\s?[(（](?:UTC|GMT|[A-Z]{2,4}T|北京时间)[^()（）\n]{0,8}[)）])?")
_TIME = (r"[0-9]{1,2}:[0-9]{2}(?::[0-9]{2}(?:[.,][0-9]{1,9})?)?(?:\s?[AaPp]\.?[Mm]\.?)?" + _TZ)
# a weekday after the date: "2026-03-15 星期日"
_WEEKDAY = r"(?:[ \t]*[（(]?(?:(?:星期|周)[一二三四五六日天]|" + _DOW + r")[)）]?)"
_ISO = r"[0-9]{4}-[0-9]{1,2}-[0-9]{1,2}" + _WEEKDAY + r"?(?:(?:T|\s)" + _TIME + r")?"
_SLASH = (r"(?:[0-9]{4}/[0-9]{1,2}/[0-9]{1,2}|[0-9]{1,2}/[0-9]{1,2}/[0-9]{2,4}"
          r"|[0-9]{1,2}\.[0-9]{1,2}\.[0-9]{4}|[0-9]{4}\.[0-9]{1,2}\.[0-9]{1,2})"
          r"(?:,?\s" + _TIME + r")?")
_RFC2822 = _DOW + r",?\s+[0-9]{1,2}\s+" + _MON + r"\s+[0-9]{4}(?:\s+" + _TIME + r")?"
_ENG_DATE = (r"(?:" + _DOW + r"\.?,?\s+)?(?:" + _MON + r"\.?\s+[0-9]{1,2}(?:st|nd|rd|th)?,?\s+"
             r"[0-9]{4}|[0-9]{1,2}(?:st|nd|rd|th)?\s+(?:of\s+)?" + _MON + r"\.?,?\s+[0-9]{4})")
_ENG = _ENG_DATE + r"(?:,?\s+(?:at\s+)?" + _TIME + r")?"
_TIME_FIRST = _TIME + r"(?:,?\s+(?:on\s+)?(?:" + _ENG_DATE + r"|[0-9]{4}-[0-9]{1,2}-[0-9]{1,2}))?"
_CN_DOW = r"(?:星期|周)[一二三四五六日天]"
_CN_TIME = (r"(?:上午|下午|晚上|凌晨|中午|早上)?\s*[0-9]{1,2}(?:[:：][0-9]{2}(?:[:：][0-9]{2})?"
            r"|[时点](?:[0-9]{1,2}分(?:[0-9]{1,2}秒)?|半)?)")
_CN = (r"(?:" + _CN_DOW + r"[，,\s]*)?(?:[0-9]{4}年)?[0-9]{1,2}月[0-9]{1,2}[日号]"
       r"(?:[，,]?\s*[（(]?" + _CN_DOW + r"[)）]?)?(?:[，,]?\s*" + _CN_TIME + r")?" + _TZ)

_DATETIME = "|".join(f"(?:{p})" for p in (_CN, _ISO, _RFC2822, _ENG, _SLASH, _TIME_FIRST,
                                          _CN_TIME + _TZ))
_EPOCH = r"[0-9]{10}(?:[0-9]{3})?(?:\.[0-9]{1,6})?"
_UUID = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
_ULID = r"[0-7][0-9A-HJKMNP-TV-Z]{25}"
_JWT = r"eyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{8,}"
_TOKEN = r"[0-9a-fA-F]{16,}|[A-Za-z0-9+/_-]{20,}={0,2}"
_ID = r"[A-Za-z0-9][A-Za-z0-9_.:-]{2,127}"

_END = r"(?![A-Za-z0-9])"
TIME_VALUE = re.compile(rf"(?P<datetime>{_DATETIME}){_END}|(?P<epoch>{_EPOCH}){_END}")
ID_VALUE = re.compile(rf"(?P<uuid>{_UUID}){_END}|(?P<jwt>{_JWT}){_END}|(?P<ulid>{_ULID}){_END}"
                      rf"|(?P<token>{_TOKEN}){_END}|(?P<id>{_ID})")
# An id an API mints per request or session, with its type as a prefix: Anthropic's `msg_…`,
# `toolu_…`, `req_…`, OpenAI's `chatcmpl-…`, `resp_…`, `call_…`, `run_…`, `thread_…`, `sess_…`,
# `conv_…`. The random part (16+ letters and digits, both) is what makes it one request's.
_PREFIXED = (r"(?:sess|session|req|msg|toolu|srvtoolu|conv|chatcmpl|cmpl|resp|run|thread|call)"
             r"[_-](?=[A-Za-z]*[0-9])(?=[0-9]*[A-Za-z])[A-Za-z0-9]{16,}")
BARE = {"uuid": re.compile(_UUID), "ulid": re.compile(_ULID), "jwt": re.compile(_JWT),
        "prefixed": re.compile(_PREFIXED)}
BARE_MIN = {"uuid": 36, "ulid": 26, "jwt": 26, "prefixed": 20}     # shortest value of each
# An id with no digit at all, after an id label: a short prefix and 8+ hex letters
# ("t_aefdfeea", "AND-BFDCEABE"), or 12+ letters of both cases ("sess_QmXkPzRtWvYb"). One in
# about 2,500 random 8-hex ids and one in 12 random 14-char base62 ids has no digit; the
# digit-bearing words the detectors start from never include them.
_DIGITLESS = tuple(re.compile(sep + r"(?:[a-fA-F]{8,}|(?=[A-Za-z]*[A-Z])(?=[A-Za-z]*[a-z])"
                              r"[A-Za-z]{12,})(?![A-Za-z0-9_-])") for sep in ("_", "-"))
_DIGITLESS_HEAD = 12         # letters of the prefix before `_` / `-`

# --- coding agents' environment (labels: labels.ENV_FIELDS, labels.ENV_BLOCKS) -----------------
_PATH = r"(?:~(?=[/\\])|[A-Za-z]:[\\/]|\\\\|/(?=[\w.~-]))"          # where a path starts
ENV_VALUES = {
    "path": re.compile(_PATH + r"[^\n<>\"'`|]*"),
    "branch": re.compile(r"[\w][\w./+@-]*"),
    "os": re.compile(r"(?i:darwin|linux|win32|windows|macos|mac ?os(?: ?x)?|os ?x|freebsd"
                     r"|openbsd|netbsd|ubuntu|debian|fedora|centos|alpine|wsl)(?![A-Za-z])"
                     r"[^\n<>]{0,80}"),
    "shell": re.compile(r"(?:SHELL=)?(?:[^\s<>]*[/\\])?(?i:bash|zsh|fish|sh|dash|ksh|tcsh|csh|nu"
                        r"|pwsh|powershell|cmd)(?:\.exe)?(?![\w])(?:[ \t]+[\w.()-]+)?"),
    "timezone": re.compile(r"[A-Z][A-Za-z_]+/[A-Za-z_]+(?:/[A-Za-z_]+)?(?:[ \t]*\([^()\n]{1,16}\))?"
                           r"|(?:UTC|GMT)(?:[ \t]?[+-][0-9]{1,2}(?::?[0-9]{2})?)?"),
    "person": re.compile(r"[^\n<>:：{}$]{1,64}"),
}
_PATH_WORD = re.compile(_PATH + r"[^\s<>\"'`|,;)\]]*")        # a path in running text
_PLACEHOLDER = re.compile(r"[{}$<>]|path/to|/your[-_/]|/\.\.\.|…")     # "/path/to/project"
# `git status --short` lines ("M src/a.ts", "?? new.py", "R  a -> b") and Claude Code's
# "(clean)"; `git log --oneline` lines ("a1b2c3d Fix the parser").
ENV_BLOCK_LINES = {
    "git_status": re.compile(r"[ \t]?[MTADRCU?!][MTADRCU?! ]?[ \t]+(?:\"[^\"\n]+\"|\S+)"
                             r"(?:[ \t]+->[ \t]+(?:\"[^\"\n]+\"|\S+))?[ \t]*"
                             r"|\((?:clean|no changes)\)|\.\.\. \(truncated[^\n]*"),
    "commits": re.compile(r"[0-9a-f]{7,40}[ \t]+\S[^\n]*"),
}
_ENV_MAX_LINES = 64          # lines a block takes at most

# A digit-bearing token: starts at a digit (a fast C scan); `scan` gives it the letters before.
# (a comma inside keeps "1,234.50" one token, so an amount's token count does not vary)
_TOKEN_SPLIT = re.compile(r"([0-9](?:[0-9A-Za-z_+/=.:,\-年月日时分秒号]*"
                          r"[0-9A-Za-z=年月日时分秒号])?)")
_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_ASCII_LETTERS = frozenset(_LETTERS)
_WORD_CHARS = _LETTERS + "0123456789_-"       # a word holding a token: "req_8f3a", "A1017"
_LEFT = frozenset(_WORD_CHARS)
_HEAD_END = frozenset(_LETTERS + "_-")
_TRIM = ".:-/+_"
_CODE = re.compile(r"```.*?(?:```|\Z)|~~~.*?(?:~~~|\Z)|`[^`\n]+`"
                   r"|<(tools|functions|tool_definitions)>.*?(?:</\1>|\Z)", re.S)
_CODE_MARKS = ("`", "~~~", "<tools>", "<functions>", "<tool_definitions>")
# After a time value, these make it part of a fixed rule or schedule, not "the time now".
_SCHEDULE = re.compile(r"\s*(?:[-–~～至到]\s*[0-9]|前|后|之前|之后|以前|以后|起|开始|截止"
                       r"|(?:before|after|until|till|or later|or earlier|onwards?)\b)", re.I)
_RANGE = re.compile(r"[0-9]{1,2}:[0-9]{2}\s*[-–~～]\s*[0-9]{1,2}:[0-9]{2}$")  # "9:00-18:00"
_CLOCK = re.compile(r"[0-9][:：][0-9]{2}|[0-9]\s*[时点]")         # a time of day in a value
# After an id label, a count or a measure is prose about ids: "is 128 bits", "64-bit".
# After an id label, a count or a measure is prose about ids: "is 128 bits", "16 hex
# characters", "64-bit", "500 以内", not an identifier.
_UNITS = ("bit", "byte", "char", "character", "digit", "letter", "word", "day", "hour", "minute",
          "second", "week", "month", "year")
_UNIT_ADJECTIVES = ("hex", "hexadecimal", "decimal", "numeric", "alphanumeric", "random", "ascii")
_COUNTERS = ("位", "个", "件", "条", "次", "人", "天", "分钟", "小时", "秒", "元", "字",
             "以内", "以上", "以下", "台", "张")
_QUANTITY = re.compile(rf"[0-9]{{1,5}}(?:[ \t]*-?[ \t]*(?:(?:{'|'.join(_UNIT_ADJECTIVES)})[ \t]+)?"
                       rf"(?:{'|'.join(_UNITS)})s?(?![A-Za-z])|[ \t]*(?:{'|'.join(_COUNTERS)}))")
_CLOSING_TAG = re.compile(r"</[A-Za-z_][\w.-]*>")
_LINE_HEAD = re.compile(r"\s*(?:[-*•>]\s+|[0-9]{1,2}[.)]\s+)?(?:\*\*|__)?")


@dataclass(slots=True)
class Found:
    """One dynamic value: `start:end` is the value; `cut` the span removed from the text
    (label and all, when the label + value form a clause of their own), else None."""
    start: int
    end: int
    value: str
    label: str
    type: str
    cut: tuple[int, int] | None = None
    at: int = -1             # where the label starts (the value's start when it has none)


def code_spans(text: str) -> list[tuple[int, int]]:
    """Fenced and inline code, and embedded tool definitions: never rewritten.

    Same spans as `_CODE.finditer(text)`, but the regex is tried only where a str.find
    (memchr speed) saw a backtick, `~~~` or a tools tag, instead of at every character."""
    starts = []
    for mark in _CODE_MARKS:
        i = text.find(mark)
        while i >= 0:
            starts.append(i)
            i = text.find(mark, i + 1)
    if not starts:
        return []
    out, pos = [], 0
    for i in sorted(starts):
        if i >= pos:
            m = _CODE.match(text, i)
            if m:
                out.append(m.span())
                pos = m.end()
    return out


def scan(text: str) -> tuple[list[tuple[int, int]], list[str], list[str]]:
    """All digit-bearing words: (spans, the static pieces between them, the words' texts).

    One C-level split finds the tokens, each starting at a digit; the letters right before
    one belong to it ("A1017", "req_8f3a", "e3b0c442-…"). That keeps a value's template the
    same whether it starts with a letter or a digit, so the learner sees one template where a
    hex id or a code varies. `statics` has one piece more than `values`.
    """
    parts = _TOKEN_SPLIT.split(text)
    head_end, word_chars = _HEAD_END, _WORD_CHARS
    for i in range(1, len(parts), 2):
        piece = parts[i - 1]
        if piece and piece[-1] in head_end:
            head = piece[len(piece.rstrip(word_chars)):].lstrip("-_")
            if head:
                parts[i - 1] = piece[:len(piece) - len(head)]
                parts[i] = head + parts[i]
    ends = list(accumulate(map(len, parts)))
    spans = list(zip(ends[0::2], ends[1::2]))
    return spans, parts[0::2], parts[1::2]


def tokens(text: str, code: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Spans of digit-bearing tokens outside code, in order."""
    return [sp for sp in scan(text)[0] if not (code and _inside_sorted(code, sp[0]))]


def _inside_sorted(code: list[tuple[int, int]], pos: int) -> bool:
    i = bisect_right(code, (pos, 1 << 62)) - 1
    return i >= 0 and pos < code[i][1]


def word_start(text: str, s: int) -> int:
    """Where the word holding the token at `s` starts: "req_8f3a", "e3b0c442-…", "A1017"."""
    while s > 0 and text[s - 1] in _LEFT:
        s -= 1
    while text[s] in "-_":
        s += 1
    return s


class Detector:
    """Compiled detectors for one configuration."""

    def __init__(self, types=TYPES, bare=("uuid", "ulid", "jwt"), time_labels=(), id_labels=(),
                 rules=()):
        self.types = frozenset(types)
        self.bare = [(t, BARE[t]) for t in bare if t in self.types]
        self.bare_min = min((BARE_MIN[t] for t, _ in self.bare), default=0)
        self.label = labels.LabelMatcher(time_labels, id_labels, WINDOW)
        self.env = labels.EnvMatcher() if "env" in self.types else None
        self.gate_words, self.gate_ends = labels.last_words(time_labels, id_labels)
        self.gate_chars = labels.last_chars(time_labels, id_labels)
        self.rules = list(rules)      # [(compiled regex, label)]

    def find(self, text: str, toks: list[tuple[int, int]], code) -> list[Found]:
        """The values to move: `candidates` less those the text only mentions (`mentions`)."""
        return mentions.drop_mentions(text, self.candidates(text, toks, code))

    def candidates(self, text: str, toks: list[tuple[int, int]], code,
                   end: int | None = None) -> list[Found]:
        """Labelled and bare typed values, digit-free ids and environment fields, then custom
        rules; sorted, non-overlapping. `toks` are the digit-bearing tokens to look at; `end`
        bounds where the others may start (`suffix_reuse` analyses only a text's head). Each
        depends only on its own line (an environment block: on the lines below it) and the
        WINDOW before it (what `suffix_reuse` relies on). The loop runs once per digit-bearing
        token, so its common path is inline."""
        found: list[Found] = []
        covered = -1
        left, gate_chars, gate_words, gate_ends = _LEFT, self.gate_chars, self.gate_words, \
            self.gate_ends
        letters, bare, bare_min = _ASCII_LETTERS, self.bare, self.bare_min
        for s, e in toks:
            if s < covered or (code and _inside_sorted(code, s)):
                continue
            while s > 0 and text[s - 1] in left:          # "req_8f3a", "e3b0c442-…"
                s -= 1
            while text[s] in "-_":
                s += 1
            if s < covered:
                continue
            # gate: could what precedes the token end a label? (a separator, a bracket, a
            # label's last word or character, or a word a date starts with: "is", "March")
            j = s - 1
            while j >= 0 and text[j] in " \t\n":
                j -= 1
            hit = None
            if j >= 0:
                c = text[j]
                if c in ",，" and j > 0:                   # "Sun, 15 Mar" / "星期日，2026年"
                    j -= 1
                    c = text[j]
                if c in gate_chars:
                    hit = self._labelled(text, s, e)
                elif c in letters:
                    k = j
                    while k >= 0 and text[k] in letters and j - k < 24:
                        k -= 1
                    word = text[k + 1:j + 1].lower()
                    if word in gate_words or word.endswith(gate_ends):
                        hit = self._labelled(text, s, e)
            if hit is None and bare and e - s >= bare_min:
                hit = self._bare(text, s, e)
            if hit is not None:
                found.append(hit)
                covered = hit.end
        end = len(text) if end is None else end
        more = self._digitless(text, code, end) if "id" in self.types else []
        if self.env is not None:
            more += self._environment(text, code, end)
        if more:
            found = _merge(found, more)
        if self.rules:
            found = _merge(found, self._rules(text, code))
        return found

    def _digitless(self, text: str, code, end: int) -> list[Found]:
        """Ids with no digit after an id label ("[Tenant ID: t_aefdfeea]"): a short prefix, then
        `_` or `-` and hex letters or mixed-case letters (`_DIGITLESS`)."""
        out = []
        for rx in _DIGITLESS:
            for m in rx.finditer(text, 0, end):
                s = m.start()
                k = s
                while k > 0 and s - k < _DIGITLESS_HEAD and text[k - 1] in _ASCII_LETTERS:
                    k -= 1
                if k == s or (k > 0 and text[k - 1] in _LEFT) or (code and _inside_sorted(code, k)):
                    continue
                lab = self.label.before(text, k)
                if lab is not None and lab.kind == "id" and lab.value_start == k:
                    out.append(Found(k, m.end(), text[k:m.end()], lab.text, "id",
                                     _clause(text, lab.start, m.end()), lab.label_start))
        return out

    def _environment(self, text: str, code, end: int) -> list[Found]:
        """Environment fields and blocks at line starts (`labels.EnvMatcher`), and paths after
        a path label in running text."""
        out: list[Found] = []
        for lab in self.env.labels(text, end):
            if lab is None or (code and _inside_sorted(code, lab.label_start)):
                continue
            f = _env_block(text, lab) if lab.kind in ENV_BLOCK_LINES else _env_field(text, lab)
            if f is not None:
                out.append(f)
        covered = {f.start for f in out}
        i = text.find("/", 0, end)
        while i >= 0:
            s = i - 1 if i > 0 and text[i - 1] == "~" else i
            if s > 0 and text[s - 1] in " \t:：=>('\"" and s not in covered and not (
                    code and _inside_sorted(code, s)):
                f = self._path_in_prose(text, s)
                if f is not None:
                    out.append(f)
                    i = f.end
            i = text.find("/", i + 1, end)
        return out

    def _path_in_prose(self, text: str, s: int) -> Found | None:
        hit = self.env.path_label(text, s)
        m = _PATH_WORD.match(text, s)
        if hit is None or m is None:
            return None
        ve = m.end()
        while ve > s and text[ve - 1] in ".:":
            ve -= 1
        value = text[s:ve]
        if len(value) < 2 or _PLACEHOLDER.search(value):
            return None
        ls, label = hit
        return Found(s, ve, value, label, "env", _clause(text, ls, ve), ls)

    def _labelled(self, text: str, s: int, e: int) -> Found | None:
        lab = self.label.before(text, s)
        if lab is None:
            return None
        vm = (ID_VALUE if lab.kind == "id" else TIME_VALUE).match(text, lab.value_start)
        if vm is None or vm.lastgroup not in self.types or vm.end() <= s:
            return None
        vs, ve = vm.span()
        while ve > vs and text[ve - 1] in _TRIM:
            ve -= 1
        if lab.kind == "id":
            if vm.lastgroup == "id" and not plausible_id(text, vs, ve):
                return None
        elif _SCHEDULE.match(text, ve) or _RANGE.search(text, vs, ve):
            return None                      # "今天18:00前下单", "now 9:00-18:00": a rule
        elif lab.kind == "fresh" and vm.lastgroup != "epoch" and not _CLOCK.search(text, vs, ve):
            return None                      # "as of 2023-05-01": how documents are dated
        ls = lab.start
        if text[max(0, ls - 4):ls].lower() == "the ":    # "The current date is …" is one clause
            ls -= 4
        return Found(vs, ve, text[vs:ve], lab.text, vm.lastgroup, _clause(text, ls, ve),
                     lab.label_start)

    def _bare(self, text: str, s: int, e: int) -> Found | None:
        for t, rx in self.bare:
            if rx.fullmatch(text, s, e):
                return Found(s, e, text[s:e], context_label(text, s), t, None, s)
        return None

    def _rules(self, text: str, code) -> list[Found]:
        out = []
        for rx, label in self.rules:
            for m in rx.finditer(text):
                g = "value" if "value" in rx.groupindex else 0
                s, e = m.span(g)
                if e > s and not _inside(code, s):
                    cut = _clause(text, m.start(), e) if g == "value" else None
                    out.append(Found(s, e, text[s:e], label or context_label(text, s), "rule",
                                     cut))
        return out


def _env_field(text: str, lab) -> Found | None:
    """The value of an environment field, when it has its kind's shape; the whole line is cut
    when the field is all the line holds."""
    line_end = text.find("\n", lab.value_start)
    line_end = len(text) if line_end < 0 else line_end
    if lab.tag:
        close = text.find(f"</{lab.text}>", lab.value_start, line_end)
        if close < 0:
            return None
        vs, ve, after = lab.value_start, close, close + len(lab.text) + 3
    else:
        vs, ve, after = lab.value_start, line_end, line_end
    while ve > vs and text[ve - 1] in " \t*_":
        ve -= 1
    if ve > vs and text[ve - 1] == "." and lab.kind != "path":
        ve -= 1
    value = text[vs:ve]
    if not value or not ENV_VALUES[lab.kind].fullmatch(value) or _PLACEHOLDER.search(value):
        return None
    own_line = not text[after:line_end].strip(" \t*_.")
    cut = (lab.line_start, min(line_end + 1, len(text))) if own_line else None
    if own_line and line_end == len(text) and lab.line_start > 0:
        cut = (lab.line_start - 1, line_end)
    return Found(vs, ve, value, lab.text, "env", cut, lab.label_start)


def _env_block(text: str, lab) -> Found | None:
    """An environment block: its label line ends at the separator; the lines below in the
    block's shape are its value ("Status:\nM src/a.ts\n?? b.py")."""
    line_end = text.find("\n", lab.value_start)
    if lab.tag or line_end < 0 or text[lab.value_start:line_end].strip(" \t*_"):
        return None
    rx, pos, last = ENV_BLOCK_LINES[lab.kind], line_end + 1, -1
    for _ in range(_ENV_MAX_LINES):
        nl = text.find("\n", pos)
        nl = len(text) if nl < 0 else nl
        if nl == pos or not rx.fullmatch(text, pos, nl):
            break
        last, pos = nl, nl + 1
        if pos > len(text):
            break
    if last < 0:
        return None
    vs = line_end + 1
    cut = (lab.line_start, last + 1) if last < len(text) else (max(lab.line_start - 1, 0), last)
    return Found(vs, last, text[vs:last], lab.text, "env", cut, lab.label_start)


def plausible_id(text: str, vs: int, ve: int) -> bool:
    """An id-like word after an id label is an identifier when it has a digit (a word alone is
    a name) and is no quantity ("Session ID is 128 bits long", "user_id: 64-bit integer")."""
    value = text[vs:ve]
    if not any(c.isdigit() for c in value):
        return False
    quantity = _QUANTITY.match(text, vs)
    return quantity is None or not (value.isdigit() or quantity.end() >= ve)


def _inside(spans, pos) -> bool:
    return any(a <= pos < b for a, b in spans)


def _merge(a: list[Found], b: list[Found]) -> list[Found]:
    out, end = [], -1
    for f in sorted(a + b, key=lambda f: (f.start, -f.end)):
        if f.start >= end:
            out.append(f)
            end = f.end
    return out


def _clause(text: str, ls: int, ve: int) -> tuple[int, int] | None:
    """The span to cut when `label … value` stands on its own: a whole line, or a sentence
    that ends right after the value. None means: replace just the value by a placeholder."""
    line_start = text.rfind("\n", 0, ls) + 1
    line_end = text.find("\n", ve)
    if line_end < 0:
        line_end = len(text)
    head = text[line_start:ls]
    rest = text[ve:line_end].strip()
    if text.startswith("<", ls) and _CLOSING_TAG.fullmatch(rest):
        rest = ""                          # "<current_date>2026-03-15</current_date>"
    if _LINE_HEAD.fullmatch(head) and rest in ("", ".", "。", ",", "，", ";", "；"):
        if line_end < len(text):
            return line_start, line_end + 1
        return (line_start - 1 if line_start > 0 else line_start), line_end
    before = head.rstrip()
    if not before or before[-1] in ".。!！?？;；，":
        if ve == line_end or text[ve:line_end].isspace():
            return ls, ve
        if text[ve] not in "。.;；!！,，":
            return None
        end = ve + 1
        while end < len(text) and text[end] in " \t":
            end += 1
        return ls, end
    return None


def context_label(text: str, pos: int, limit: int = 32) -> str:
    """The words before `pos` on its line (up to `limit` chars): a label for an unlabeled value."""
    line_start = text.rfind("\n", 0, pos) + 1
    head = text[max(line_start, pos - limit):pos]
    for stop in (". ", "。", "! ", "? ", "; ", "；", "：", ": "):
        i = head.rfind(stop)
        if i >= 0 and head[i + len(stop):].strip():
            head = head[i + len(stop):]
    if pos - limit > line_start and " " in head:
        head = head[head.index(" ") + 1:]
    return head.strip(" \t*_-#>:：,，(（[").strip()
