"""The engine's model steps against this machine's floors:
`python -m prefixgate.backend.bench.steps`.

Loads `--model` as the engine serves it (its dtype, projections fused and linears prepacked:
backend/cpu_linear.py; `--plain` skips that, to see what it buys), then times, through the
paged-KV path of backend/models/llama.py, a cold prefill of each of `--prefill-tokens` and a
decode step of each of `--batches` sequences at `--context` tokens. The limits probe
(bench/limits.py) runs first in the same process on the same threads, and every figure is also
given as its fraction of the floor (1.0: the machine's limit). Medians over `--repeats`; run it
pinned (`taskset -c 0`) with `--threads 1` to measure one core. `--baseline-plain PARTS` times
every step a second time with those compiled operators off (backend/cpu_ops.py's PARTS, or
`all`), the two alternating step by step in one process, so that a busy machine slows both
alike: the speed-up is measured side by side.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import time

import torch

from prefixgate.backend import cpu_ops
from prefixgate.backend.attention import AttentionMetadata
from prefixgate.backend.bench import limits as probe
from prefixgate.backend.bench.script import add_dtype_arg, int_list, run_report_save
from prefixgate.backend.bench.vocab import MODEL_HELP
from prefixgate.backend.config import resolve_model
from prefixgate.backend.cpu_linear import prepare_for_inference
from prefixgate.backend.loader import load_model, serving_dtype

BLOCK = 16


def paged_cache(config, tokens: int, dtype: torch.dtype) -> list[tuple]:
    """Per layer an empty (k, v) paged cache with room for `tokens` tokens."""
    shape = (-(-tokens // BLOCK), BLOCK, config.num_key_value_heads, config.head_dim)
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(config.num_hidden_layers)]


def forward_s(model, config, kv, lens: list[int], new: int | list[int], repeats: int,
              variants=(contextlib.nullcontext,)) -> list[float]:
    """Median seconds of one step per variant (a context to run it in), the variants taking
    turns: each sequence (its cache already holding lens[s] - new[s] tokens) computes new[s]
    tokens (`new` alone: as many for each); the last token's logits of each, as the engine
    asks."""
    news = new if isinstance(new, list) else [new] * len(lens)
    pages = -(-max(lens) // BLOCK)
    tables = torch.arange(len(lens) * pages, dtype=torch.int32).view(len(lens), pages)
    slots = [s * pages * BLOCK + p for s, (n, k) in enumerate(zip(lens, news))
             for p in range(n - k, n)]
    starts = [0, *itertools.accumulate(news)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=tables,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_seq_len=max(lens), is_decode=set(news) == {1})
    ids = torch.randint(0, config.vocab_size, (len(slots),),
                        generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([p for n, k in zip(lens, news) for p in range(n - k, n)])
    last = torch.tensor(starts[1:]) - 1
    times = [[] for _ in variants]
    with torch.inference_mode():
        for _ in range(repeats + 1):           # the first is a warm-up
            for variant, samples in zip(variants, times, strict=True):
                with variant():
                    start = time.perf_counter()
                    model.compute_logits(model(ids, positions, meta, kv)[last])
                    samples.append(time.perf_counter() - start)
    return [statistics.median(samples[1:]) for samples in times]


def run(args) -> dict:
    limits = probe.measure_limits(args.threads,
                                  probe.Effort.quick() if args.quick else probe.Effort())
    path = resolve_model(args.model)
    dtype = serving_dtype(args.dtype, torch.device("cpu"))
    model, config = load_model(path, dtype=dtype)
    packed = 0 if args.plain else prepare_for_inference(model)
    weight_dtype = model.model.embed_tokens.weight.dtype
    dtype_name = str(weight_dtype).removeprefix("torch.")
    floors = probe.Floors(limits, probe.ModelCost.of(config))
    pages = -(-max([*args.prefill_tokens, args.context]) // BLOCK)
    sequences = max([1, *args.batches, *(b + 1 for b in args.mixed)])
    kv = paged_cache(config, sequences * pages * BLOCK, weight_dtype)
    variants = [contextlib.nullcontext]
    if args.baseline_plain:
        variants.append(lambda: cpu_ops.plain(*args.baseline_plain))
    prefill = {n: forward_s(model, config, kv, [n], n, args.repeats, variants)
               for n in args.prefill_tokens}
    decode = {b: forward_s(model, config, kv, [args.context] * b, 1, args.repeats, variants)
              for b in args.batches}
    # the second half of a prompt of --context tokens beside decodes at that length (at 1,024:
    # the steps of vLLM's `random` load, 1,024-token prompts, under a 512-token step budget)
    mixed = {b: forward_s(model, config, kv, [args.context] * (b + 1),
                          [1] * b + [args.context - args.context // 2], args.repeats, variants)
             for b in args.mixed}
    return {
        "config": dict(vars(args)), "dtype": dtype_name, "packed_linears": packed,
        "limits": limits.to_dict(),
        "prefill": {n: {"s": s[0], "floor_s": floors.prefill_s(n, dtype_name),
                        "fraction": floors.prefill_fraction(n, s[0], dtype_name),
                        **baseline(s, 1)}
                    for n, s in prefill.items()},
        "decode": {b: {"ms": s[0] * 1e3,
                       "floor_ms": floors.decode_step(b, dtype_name, args.context)["s"] * 1e3,
                       "fraction": floors.decode_fraction(b, s[0], dtype_name, args.context),
                       **baseline(s, 1e3)}
                   for b, s in decode.items()},
        "mixed": {b: {"ms": s[0] * 1e3, **baseline(s, 1e3)} for b, s in mixed.items()},
    }


def baseline(seconds: list[float], unit: float) -> dict:
    """The baseline's median (in the unit of the figure beside it) and the speed-up over it."""
    if len(seconds) == 1:
        return {}
    return {"baseline": seconds[1] * unit, "speedup": seconds[1] / seconds[0]}


def report(result: dict) -> None:
    c = result["config"]
    form = "as loaded (--plain)" if c["plain"] else (
        f"fused, {result['packed_linears']} linears prepacked")
    print(f"{c['model']} in {result['dtype']}, {form}, {c['threads']} thread(s); "
          f"median of {c['repeats']}; fraction = floor / measured")
    if c["baseline_plain"]:
        print(f"  baseline: the same steps with {', '.join(c['baseline_plain'])} as PyTorch's "
              f"operators, taking turns with the default")
    for n, r in result["prefill"].items():
        print(f"  prefill {n:>6,} tokens  {r['s']:8.3f} s    floor {r['floor_s']:7.3f} s    "
              f"{r['fraction']:.2f}" + against_baseline(r, "s", 3))
    for b, r in result["decode"].items():
        print(f"  decode batch {b:>3} at {c['context']:,}  {r['ms']:6.1f} ms    floor "
              f"{r['floor_ms']:5.1f} ms    {r['fraction']:.2f}" + against_baseline(r, "ms", 1))
    for b, r in result.get("mixed", {}).items():
        chunk = c["context"] - c["context"] // 2
        print(f"  mixed: {b} decodes at {c['context']:,} + a {chunk:,}-token chunk over "
              f"{c['context'] // 2:,}  {r['ms']:6.1f} ms" + against_baseline(r, "ms", 1))


def against_baseline(row: dict, unit: str, digits: int) -> str:
    if "baseline" not in row:
        return ""
    return f"    baseline {row['baseline']:.{digits}f} {unit}    {row['speedup']:.2f}x"


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(prog="python -m prefixgate.backend.bench.steps",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help=MODEL_HELP)
    add_dtype_arg(p)
    p.add_argument("--plain", action="store_true",
                   help="the model as loaded: projections not fused, linears not prepacked")
    p.add_argument("--prefill-tokens", type=int_list, default=[512, 2400])
    p.add_argument("--batches", type=int_list, default=[1, 8, 32])
    p.add_argument("--context", type=int, default=1024, help="decode: tokens per sequence")
    p.add_argument("--mixed", type=int_list_or_none, default=[8], metavar="DECODES",
                   help="mixed steps: these many decodes at --context beside the second half "
                        "of a prompt as long (empty: none)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--baseline-plain", type=plain_parts, default=None, metavar="PARTS",
                   help="also time each step with these compiled operators off, in turns with "
                        f"the default: comma-separated of {', '.join(cpu_ops.PARTS)}, or all")
    p.add_argument("--quick", action="store_true",
                   help="the limits probe's quick form: to see that it works, not to measure")
    p.add_argument("--out", help="save the result as JSON here")
    return p.parse_args(argv)


def int_list_or_none(text: str) -> list[int]:
    """int_list, and `` for none."""
    return int_list(text) if text else []


def plain_parts(value: str) -> list[str]:
    parts = list(cpu_ops.PARTS) if value == "all" else [v for v in value.split(",") if v]
    try:
        cpu_ops.check_parts(parts or [value])
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{error}, or all") from None
    return parts


def main(argv: list[str] | None = None) -> int:
    return run_report_save(run, report, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
