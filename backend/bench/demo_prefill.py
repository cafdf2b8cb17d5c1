"""The demo model's size and speed: `python -m prefixgate.backend.bench.demo_prefill` builds it
(if needed, backend/demo.py), loads it and times a prefill through the paged-KV path."""
from __future__ import annotations

import argparse
import time

import torch

from prefixgate.backend.bench.steps import forward_s, paged_cache
from prefixgate.backend.demo import ensure_demo_model
from prefixgate.backend.loader import load_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefixgate.backend.bench.demo_prefill",
                                     description="Build (if needed) the demo model and time a "
                                                 "prefill.")
    parser.add_argument("--cache-dir", help="default: $PREFIXGATE_CACHE or ~/.cache/prefixgate")
    parser.add_argument("--prefill-tokens", type=int, default=2400)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    model_dir = ensure_demo_model(args.cache_dir)
    built = time.perf_counter()
    model, config = load_model(model_dir)
    loaded = time.perf_counter()
    params = sum(p.numel() for p in model.parameters())
    print(f"demo model: {model_dir} ({params / 1e6:.1f}M parameters, "
          f"context {config.max_position_embeddings})")
    print(f"ensure_demo_model: {built - start:.2f} s, load_model: {loaded - built:.2f} s")
    n = args.prefill_tokens
    [seconds] = forward_s(model, config, paged_cache(config, n, torch.float32), [n], n,
                          args.repeats)
    print(f"prefill of {n} tokens (fp32, CPU): median {seconds:.2f} s over {args.repeats} runs "
          f"(after a warm-up)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
