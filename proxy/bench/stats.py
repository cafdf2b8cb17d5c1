"""Summaries and tables for `prefixgate bench`: percentiles per cell, and A/B ratio tables."""
from __future__ import annotations

from prefixgate.common.percentiles import percentile


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 3)


def summarize(samples: list, slo_ttft_s: float) -> dict:
    """One cell's figures from its measured (non-warm-up) samples; times in milliseconds."""
    measured = [s for s in samples if not s.warmup]
    ok = [s for s in measured if s.ok]
    ttft = [s.ttft for s in ok]
    tpot = [s.tpot for s in ok if s.tpot is not None]
    itl = [g for s in ok for g in s.itl]
    if measured:
        t_start = min(s.start for s in measured)
        t_end = max(s.start + (s.latency or s.ttft or 0.0) for s in measured)
        wall = max(t_end - t_start, 1e-9)
    else:
        wall = 0.0
    good = sum(1 for s in ok if s.ttft <= slo_ttft_s)
    out = {"requests": len(measured), "errors": len(measured) - len(ok), "wall_s": round(wall, 4)}
    for q in (50, 90, 95, 99):
        out[f"ttft_p{q}_ms"] = _ms(percentile(ttft, q))
    out["ttft_mean_ms"] = _ms(sum(ttft) / len(ttft)) if ttft else None
    out["tpot_p50_ms"], out["tpot_p95_ms"] = _ms(percentile(tpot, 50)), _ms(percentile(tpot, 95))
    out["itl_p50_ms"], out["itl_p99_ms"] = _ms(percentile(itl, 50)), _ms(percentile(itl, 99))
    out["req_per_s"] = round(len(ok) / wall, 3) if wall else None
    out["out_tok_per_s"] = round(sum(s.output_tokens for s in ok) / wall, 2) if wall else None
    out["goodput_req_per_s"] = round(good / wall, 3) if wall else None
    out["goodput_frac"] = round(good / len(measured), 4) if measured else None
    predicted = prediction_errors(samples)
    if predicted:
        out["prediction_error_p50"] = round(percentile(predicted, 50), 4)
        out["prediction_error_n"] = len(predicted)
    timing = server_timing_p50(ok)
    if timing:
        out["server_timing_p50"] = timing
    errors = [s.error for s in measured if s.error]
    if errors:
        out["first_error"] = errors[0]
    return out


WARM_REQUESTS = 50      # an upstream's first answers, while predicted_ttft's fit is learning


def prediction_errors(samples: list, warm: int = WARM_REQUESTS) -> list[float]:
    """|predicted − measured| / measured TTFT of each answered request the gateway predicted
    (`policy: predicted_ttft`), leaving out each upstream's first `warm` requests."""
    seen: dict[str, int] = {}
    out = []
    for s in sorted(samples, key=lambda s: s.start):
        if s.upstream is None:
            continue
        seen[s.upstream] = n = seen.get(s.upstream, 0) + 1
        if n > warm and s.ok and s.predicted_ttft_ms is not None and s.ttft > 0:
            out.append(abs(s.predicted_ttft_ms / 1e3 - s.ttft) / s.ttft)
    return out


# the order a request meets them: the gateway's, then the engine's; others after, as they come
TIMING_ORDER = ("gw", "gw-queue", "connect", "upstream", "tokenize", "queue", "prefill", "decode")


def server_timing_p50(samples: list) -> dict[str, float]:
    """Median ms of each Server-Timing entry over the samples that carry it ({} when none
    does: the server sends no header, e.g. vLLM, or an archive from before the field)."""
    values: dict[str, list[float]] = {}
    for s in samples:
        timing = (s.get("server_timing") if isinstance(s, dict)
                  else getattr(s, "server_timing", None))
        for name, ms in (timing or {}).items():
            values.setdefault(name, []).append(ms)
    names = [n for n in TIMING_ORDER if n in values] + [n for n in values if n not in TIMING_ORDER]
    return {n: round(percentile(values[n], 50), 3) for n in names}


def server_timing_lines(cells: list[dict]) -> list[str]:
    """One line per cell whose summary has Server-Timing medians, e.g.
    `tier=512 c=8  server-timing p50 ms: queue 12.1, prefill 80.4, decode 0.9`."""
    width = max([len(c["label"]) for c in cells] + [4])
    return [f"{c['label'].ljust(width)}  server-timing p50 ms: " + ", ".join(
                f"{name} {ms:.1f}" for name, ms in c["summary"]["server_timing_p50"].items())
            for c in cells if c["summary"].get("server_timing_p50")]


def fmt(v, width: int = 8, digits: int = 1) -> str:
    if v is None:
        return "-".rjust(width)
    if isinstance(v, float):
        return f"{v:.{digits}f}".rjust(width)
    return str(v).rjust(width)


CELL_COLUMNS = [("cell", None), ("n", "requests"), ("err", "errors"),
                ("ttft p50", "ttft_p50_ms"), ("p95", "ttft_p95_ms"), ("p99", "ttft_p99_ms"),
                ("tpot p50", "tpot_p50_ms"), ("itl p99", "itl_p99_ms"),
                ("req/s", "req_per_s"), ("tok/s", "out_tok_per_s"), ("good/s", "goodput_req_per_s"),
                ("good%", "goodput_frac")]


def cell_table(cells: list[dict]) -> str:
    """Rows of `cells` (each with `label` and `summary`); latencies in ms."""
    width = max([len(c["label"]) for c in cells] + [4])
    head = "cell".ljust(width) + "".join(h.rjust(9) for h, _ in CELL_COLUMNS[1:])
    lines = [head, "-" * len(head)]
    for c in cells:
        s = c["summary"]
        row = c["label"].ljust(width)
        for _, key in CELL_COLUMNS[1:]:
            v = s.get(key)
            if key == "goodput_frac" and v is not None:
                v = 100.0 * v
            row += " " + fmt(v, 8, 2 if key in ("req_per_s", "goodput_req_per_s") else 1)
        lines.append(row)
    return "\n".join(lines)


def reduction(base: float | None, new: float | None) -> float | None:
    """Percent by which `new` is lower than `base` (negative: worse)."""
    if base is None or new is None or base <= 0:
        return None
    return round(100.0 * (base - new) / base, 1)


def compare_table(a: dict, b: dict) -> str:
    """Cells present in both archives, matched by label: p50/p95/p99 TTFT of A and B, ratio."""
    bcells = {c["label"]: c["summary"] for c in b["cells"]}
    width = max([len(c["label"]) for c in a["cells"]] + [4])
    head = ("cell".ljust(width) + "".join(h.rjust(10) for h in (
        "A p50", "A p95", "A p99", "B p50", "B p95", "B p99", "B/A p50", "B/A p95", "B/A p99")))
    lines = [head, "-" * len(head)]
    matched = 0
    for c in a["cells"]:
        sb = bcells.get(c["label"])
        if sb is None:
            continue
        matched += 1
        sa = c["summary"]
        keys = ("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms")
        ratios = [None if not sa.get(k) or sb.get(k) is None else sb[k] / sa[k] for k in keys]
        lines.append(c["label"].ljust(width) + "".join(
            " " + fmt(v, 9) for v in [*(sa.get(k) for k in keys), *(sb.get(k) for k in keys)])
            + "".join(" " + fmt(r, 9, 3) for r in ratios))
    if not matched:
        return "no cells in common (compare archives made with the same tiers/concurrency)"
    return "\n".join(lines)
