"""What every engine benchmark's command line shares: `--threads`, comma-separated lists, and
its ending (run, report, save the result as JSON)."""
from __future__ import annotations

import asyncio
import inspect
import json
import time
from pathlib import Path

THREADS_HELP = "torch CPU threads for the engine (and transformers) (default: torch's)"


def add_dtype_arg(parser) -> None:
    """`--dtype`: float32 or bfloat16, default the engine's own choice (loader.serving_dtype)."""
    parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                        help="default: the engine's (bf16 where the CPU multiplies it natively)")


def int_list(text: str) -> list[int]:
    """An argparse type: `1,8,32` -> [1, 8, 32]."""
    return [int(x) for x in text.split(",")]


def save_json(result: dict, out: str | None) -> None:
    """The result as JSON where `--out` says (nothing without one)."""
    if out:
        Path(out).write_text(json.dumps(result, indent=2))


def run_report_save(run, report, args) -> int:
    """The engine benchmarks' ending: torch's CPU threads as `--threads` says (where the
    benchmark has the flag), `run(args)` (awaited on a new event loop when it is a
    coroutine), `report(result)`, and the result saved as JSON where `--out` says."""
    t0 = time.monotonic()
    if getattr(args, "threads", None):
        import torch
        torch.set_num_threads(args.threads)
    result = run(args)
    if inspect.iscoroutine(result):
        result = asyncio.run(result)
    report(result)
    if args.out:
        save_json(result, args.out)
        print(f"saved {args.out} ({time.monotonic() - t0:.0f}s)")
    return 0
