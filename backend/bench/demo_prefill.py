"""The demo model's size and speed: `python -m prefixgate.backend.bench.demo_prefill` builds it
(if needed, backend/demo.py), loads it and times a prefill through the paged-KV path."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from prefixgate.backend.attention import AttentionMetadata
from prefixgate.backend.demo import ensure_demo_model
from prefixgate.backend.loader import load_model


def time_prefill(model, config, num_tokens: int, block_size: int = 16) -> float:
    """Seconds for one forward over `num_tokens` new tokens through the paged-KV path."""
    blocks = -(-num_tokens // block_size)
    shape = (blocks, block_size, config.num_key_value_heads, config.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        max_seq_len=num_tokens,
        is_decode=False,
    )
    ids = torch.randint(0, config.vocab_size, (num_tokens,),
                        generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        start = time.perf_counter()
        model.compute_logits(model(ids, torch.arange(num_tokens), meta, kv)[-1:])
        return time.perf_counter() - start


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
    time_prefill(model, config, min(64, args.prefill_tokens))  # warm-up
    times = [time_prefill(model, config, args.prefill_tokens) for _ in range(args.repeats)]
    print(f"prefill of {args.prefill_tokens} tokens (fp32, CPU): "
          f"median {statistics.median(times):.2f} s over {args.repeats} runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
