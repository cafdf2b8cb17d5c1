"""The serving benchmark's printed report (bench/serving.py): one function per part, each
printing its figures as the part finishes, beside the part's target where it has one."""
from __future__ import annotations

TARGETS = {"prefix_50": 1.8, "prefix_80": 3.5, "chunked_p95": 3.0, "throughput": 4.0}


def _verdict(ratio: float, key: str) -> str:
    met = "met" if ratio >= TARGETS[key] else "MISSED"
    return f"{ratio:.2f}x (target >= {TARGETS[key]}x: {met})"


def report_prefix_cache(r):
    m, lim = r["ttft_median_s"], r["flop_limit"]
    print(f"a) prefix cache, 2,400-token prompt TTFT median: cold {m['cold'] * 1e3:.0f} ms, "
          f"50% served before {m['shared_50'] * 1e3:.0f} ms, 80% {m['shared_80'] * 1e3:.0f} ms")
    print(f"   speed-up 50%: {_verdict(r['prefix_50'], 'prefix_50')}; "
          f"80%: {_verdict(r['prefix_80'], 'prefix_80')}")
    p = r["paired_ratio_median"]
    print(f"   (median of per-repeat cold/warm ratios: 50% {p['50']:.2f}x, 80% {p['80']:.2f}x; "
          f"FLOP limit: 50% {lim['50']:.2f}x, 80% {lim['80']:.2f}x)")


def report_chunked_prefill(r):
    m = r["short_p95_ttft_median_s"]
    print(f"b) 4,000-token prompt + 16 short ones, short p95 TTFT (median of runs): chunked "
          f"{m['chunked'] * 1e3:.0f} ms, whole prompts {m['whole_prompts'] * 1e3:.0f} ms")
    print(f"   improvement: {_verdict(r['chunked_p95'], 'chunked_p95')}")


def report_continuous_batching(r):
    print(f"c) 16 x 128 tokens (medians): engine {r['engine_s']:.1f} s "
          f"({r['engine_tok_per_s']:.0f} tok/s), transformers one by one "
          f"{r['transformers_s']:.1f} s ({r['transformers_tok_per_s']:.0f} tok/s)")
    print(f"   throughput: {_verdict(r['throughput'], 'throughput')}")


def report_warmup(r):
    m = r["medians"]
    print(f"d) fresh engine processes, medians of runs; first request: "
          f"a {r['prompt_tokens']}-token prompt")
    for fmt in ("mmap", "eager"):
        warm, skip = m[f"{fmt}_warm"], m[f"{fmt}_skip"]
        print(f"   {fmt:5}: /health 200 after {warm['ready_s']:.2f} s "
              f"(listening at {warm['listening_s']:.2f} s; "
              f"{skip['ready_s']:.2f} s with --skip-server-warmup); "
              f"first TTFT {warm['first_ttft_s'] * 1e3:.0f} ms "
              f"warmed vs {skip['first_ttft_s'] * 1e3:.0f} ms skipped: "
              f"{r['first_ttft_skip_over_warm'][fmt]:.2f}x; "
              f"second TTFT {warm['second_ttft_s'] * 1e3:.0f} / "
              f"{skip['second_ttft_s'] * 1e3:.0f} ms")


def report_prompt_lengths(r):
    pct = str(round(r["shared"] * 100))
    print(f"e) TTFT by prompt length (medians), cold and with {pct}% served before; "
          f"FLOP limit = cold/warm prefill FLOPs")
    for tokens, t in r["tiers"].items():
        m = t["ttft_median_s"]
        print(f"   {int(tokens):>6,} tokens: cold {m['cold'] * 1e3:8.0f} ms, "
              f"warm {m['shared_' + pct] * 1e3:7.0f} ms, {t['speedup'][pct]:5.2f}x "
              f"(paired {t['paired_ratio_median'][pct]:.2f}x; FLOP limit "
              f"{t['flop_limit'][pct]:.2f}x)")


def report_decode(r):
    print(f"f) decode, {r['new_tokens']} tokens per request (medians): batch, TPOT p50, "
          f"batch / TPOT")
    for b, d in r["batches"].items():
        print(f"   batch {int(b):>3}: {d['tpot_p50_s'] * 1e3:7.1f} ms, "
              f"{d['tok_per_s']:7.1f} tok/s")
