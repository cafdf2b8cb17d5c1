"""`prefixgate doctor` (c): per-request values in a prompt's head, and where prompts diverge.

Detection is the `normalize` plugin's own (typed, labelled detectors with its defaults), run
on a copy of the request: what it would move is what breaks the prefix cache. Offsets are in
the rendered prompt: the model's chat template when a tokenizer is given (then in tokens
too), else a ChatML-like rendering that keeps the messages' order and text. Each request is
analysed as its model's (`model`, as `normalize` would see it in the gateway); two requests
for different models never share a prefix cache, so they are not compared.
"""
from __future__ import annotations

import copy
import json

from prefixgate.common.schema import check
from prefixgate.plugins.normalize.plugin import SPEC, Normalizer
from prefixgate.proxy.doctor.checks import FIX_DYNAMIC, SHAREABLE_LOW, Finding


def normalizer() -> Normalizer:
    # learning needs traffic; the doctor sees one or two requests, so typed detection only
    return Normalizer(check({"learn": False}, SPEC))


def render(body: dict, tokenizer=None) -> str:
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        return str(body.get("prompt", ""))
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(msgs, tools=body.get("tools"))
        except ValueError:
            pass
    parts = []
    for i, m in enumerate(msgs):
        content = m.get("content") if isinstance(m, dict) else m
        if not isinstance(content, str):
            content = json.dumps(content, ensure_ascii=False)
        parts.append(f"<|{m.get('role') if isinstance(m, dict) else '?'}|>\n{content}\n")
        if i == 0 and body.get("tools"):
            parts.append(json.dumps(body["tools"], ensure_ascii=False) + "\n")
    return "".join(parts)


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def offsets(a: str, b: str, tokenizer=None) -> dict:
    """Where two renderings part: characters, and tokens when a tokenizer is known."""
    out = {"chars": common_prefix(a, b), "of_chars": len(a)}
    if tokenizer is not None:
        ta, tb = tokenizer.encode(a), tokenizer.encode(b)
        out.update(tokens=common_prefix(ta, tb), of_tokens=len(ta))
    return out


def where(off: dict) -> str:
    s = f"char {off['chars']} of {off['of_chars']}"
    if "tokens" in off:
        s += f" (token {off['tokens']} of {off['of_tokens']})"
    return s


def dynamic_fields(name: str, body: dict, tokenizer=None, model: str | None = None) -> Finding:
    """Per-request values in the request's system/developer messages (`model`: the model the
    request is for; default: its own `model`)."""
    fixed = copy.deepcopy(body)
    moved = normalizer().normalize(fixed, model or _model(body))
    if not moved:
        return Finding("c", f"dynamic fields ({name})", "PASS", "no per-request values (times, "
                       "request ids, nonces) in the system prompt")
    off = offsets(render(body, tokenizer), render(fixed, tokenizer), tokenizer)
    values = "; ".join(f"{m['label'] or '?'} = {m['value']!r} ({m['type']}, message "
                       f"{m['message']})" for m in moved[:4])
    share = off["chars"] / max(off["of_chars"], 1)
    return Finding("c", f"dynamic fields ({name})", "FAIL", f"{len(moved)} per-request value(s) "
                   f"in the prompt: {values}. The first sits at {where(off)}: only the "
                   f"{share:.0%} before it can come from the prefix cache", FIX_DYNAMIC,
                   {"moved": moved, "offset": off})


def _model(body: dict) -> str | None:
    model = body.get("model")
    return model if isinstance(model, str) and model else None


def divergence(a: dict, b: dict, tokenizer=None, models=None) -> Finding:
    """Where two real requests part, before and after normalization. `models`: the models
    the two are for (default: their own `model`s); for two different models, nothing to
    compare: each model has a prefix cache of its own."""
    ma, mb = models or (_model(a), _model(b))
    if ma is not None and mb is not None and ma != mb:
        return Finding("c", "divergence", "INFO", f"the two requests are for different models "
                       f"({ma!r}, {mb!r}), which never share a prefix cache: compare two "
                       f"requests for one model", data={"models": [ma, mb]})
    ra, rb = render(a, tokenizer), render(b, tokenizer)
    before = offsets(ra, rb, tokenizer)
    na, nb = copy.deepcopy(a), copy.deepcopy(b)
    n = normalizer()
    n.normalize(na, ma)
    n.normalize(nb, mb)
    after = offsets(render(na, tokenizer), render(nb, tokenizer), tokenizer)
    share = before["chars"] / max(before["of_chars"], 1)
    data = {"before": before, "after_normalize": after}
    text = (f"the two requests diverge at {where(before)}: {share:.0%} of the first is a "
            f"shared prefix")
    if after["chars"] > before["chars"]:
        text += f"; after normalize they would share up to {where(after)}"
    if share >= SHAREABLE_LOW:
        return Finding("c", "divergence", "PASS", text, data=data)
    in_system = _in_system(a, ra, before["chars"], tokenizer)
    if not in_system:
        return Finding("c", "divergence", "INFO", text + " (in the per-request part)", data=data)
    return Finding("c", "divergence", "WARN", text + ", inside the system prompt",
                   FIX_DYNAMIC if after["chars"] > before["chars"] else (
                       "keep the system prompt identical across requests; put per-user or "
                       "per-request content after it"), data)


def _in_system(body: dict, rendered: str, pos: int, tokenizer) -> bool:
    """Whether character `pos` of the rendering falls in the leading system message."""
    msgs = body.get("messages") or []
    if not msgs or not isinstance(msgs[0], dict) or msgs[0].get("role") not in (
            "system", "developer"):
        return False
    head = render({**body, "messages": msgs[:1]}, tokenizer)
    return pos < common_prefix(rendered, head)
