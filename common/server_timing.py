"""The `Server-Timing` response header (W3C Server Timing): where a response's time went.

The bundled engine sends `queue;dur=12.1, prefill;dur=80.4;desc="computed=96 cached=64",
decode;dur=0.9`; the gateway reads any upstream's entries and appends its own (`gw`,
`gw-queue`, `connect`, `upstream`). `prefixgate bench` and `prefixgate doctor` read the
header the client got. Durations are milliseconds.
"""
from __future__ import annotations

HEADER = "Server-Timing"


def parse(value: str | None) -> dict[str, float]:
    """{metric name: dur in ms} of a Server-Timing header; the first entry of a name wins,
    entries without a (numeric) dur are left out."""
    out: dict[str, float] = {}
    if not value:
        return out
    for entry in value.split(","):
        name, _, params = entry.partition(";")
        name = name.strip()
        if not name or name in out:
            continue
        for param in params.split(";"):
            key, _, raw = param.partition("=")
            if key.strip().lower() == "dur":
                try:
                    out[name] = float(raw.strip().strip('"'))
                except ValueError:
                    pass
                break
    return out


def entry(name: str, ms: float, desc: str | None = None) -> str:
    """One metric, e.g. `prefill;dur=80.4;desc="computed=96 cached=64"`."""
    text = f"{name};dur={ms:.1f}"
    if desc:
        text += f';desc="{desc}"'
    return text


def join(*parts: str | None) -> str:
    """Header values (or entries) joined as one list, empty ones skipped."""
    return ", ".join(p for p in parts if p)
