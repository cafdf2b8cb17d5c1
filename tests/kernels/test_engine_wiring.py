"""The engine with the Triton kernels forced on (interpreter on CPU, native on CUDA) generates
the same greedy tokens as with the PyTorch references: prefix-cache hits, chunked prefill,
batched decode, and an FP8 KV cache all go through the kernels."""
import os

import pytest
import torch

from prefixgate.backend.attention import AttentionMetadata
from prefixgate.backend.config import EngineArgs
from prefixgate.backend.engine import LLMEngine
from prefixgate.backend.loader import load_model
from prefixgate.backend.sampling import SamplingParams
from tests.helpers import make_tiny_model

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1"
                                and not torch.cuda.is_available(),
                                reason="Triton needs CUDA or TRITON_INTERPRET=1")
SHARED = [(7 * i + 3) % 300 + 5 for i in range(37)]       # 37 tokens: 2 full blocks + 5 cached


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), kind="qwen2")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def generate(model_dir, backend: str, kv_cache_dtype: str = "auto"):
    engine = LLMEngine(EngineArgs(model=str(model_dir), device=DEVICE, dtype="float32",
                                  attention_backend=backend, kv_cache_dtype=kv_cache_dtype,
                                  num_kv_blocks=48, max_num_batched_tokens=24,
                                  enforce_eager=True))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {}

    def run(prompts: dict[str, list[int]]):
        for rid, ids in prompts.items():
            engine.add_request(rid, ids, params)
            out[rid] = []
        while engine.has_work():
            for o in engine.step():
                out[o.request_id] += o.token_ids

    run({"first": SHARED + [11, 12, 13]})
    # Second wave: two prompts reuse the cached blocks of the first (prefill over a cached prefix,
    # in chunks of 24 tokens), one shares nothing; their decodes run batched.
    run({"hit-a": SHARED + [21, 22, 23, 24, 25, 26, 27, 28, 29, 30],
         "hit-b": SHARED[:35] + [40, 41],
         "cold": [(5 * i + 1) % 290 + 3 for i in range(29)]})
    assert engine.stats()["prefix_hits"] > 0
    return out


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_engine_triton_kernels_match_reference(model_dir, kv_cache_dtype):
    ref = generate(model_dir, "torch", kv_cache_dtype)
    got = generate(model_dir, "triton", kv_cache_dtype)
    assert all(len(toks) == 6 for toks in ref.values())
    assert got == ref
    import sys
    assert {"prefixgate.kernels.decode_attention_triton",
            "prefixgate.kernels.prefill_attention_triton",
            "prefixgate.kernels.write_kv_triton"} <= set(sys.modules)


def step(model, kv_caches, backend, chunks, block_size=16):
    """One forward over chunks [(token_ids, block_table, start)] through the model's paged
    attention."""
    ids, pos, slots, lens, starts, tables = [], [], [], [], [0], []
    for tokens, table, start in chunks:
        end = start + len(tokens)
        ids += tokens
        pos += range(start, end)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        lens.append(end)
        starts.append(starts[-1] + len(tokens))
        tables.append(table + [0] * (4 - len(table)))

    def tensor(x, dtype):
        return torch.tensor(x, dtype=dtype, device=DEVICE)

    meta = AttentionMetadata(slot_mapping=tensor(slots, torch.int64),
                             block_tables=tensor(tables, torch.int32),
                             seq_lens=tensor(lens, torch.int32),
                             query_start_loc=tensor(starts, torch.int32),
                             max_seq_len=max(lens), is_decode=all(len(c[0]) == 1 for c in chunks),
                             attention_backend=backend)
    with torch.inference_mode():
        return model(tensor(ids, torch.int64), tensor(pos, torch.int64), meta, kv_caches)


def test_model_hidden_states_match_reference_through_chunks_and_decode(model_dir):
    """Tighter than token equality: every hidden state of a chunked, prefix-cached batch and of
    the decode steps after it matches the reference path to float tolerance."""
    model, cfg = load_model(model_dir, device=DEVICE)
    shape = (12, 16, cfg.num_key_value_heads, cfg.head_dim)
    a, b = SHARED + [9, 8, 7], [(3 * i + 2) % 300 + 4 for i in range(21)]
    ta, tb = [5, 2, 9], [7, 1]
    hidden = {}
    for backend in ("torch", "triton"):
        caches = [(torch.zeros(shape, device=DEVICE), torch.zeros(shape, device=DEVICE))
                  for _ in range(cfg.num_hidden_layers)]
        hidden[backend] = [
            # prefix 0, then unaligned prefixes, then two decode steps
            step(model, caches, backend, [(a[:20], ta, 0), (b[:13], tb, 0)]),
            step(model, caches, backend, [(a[20:], ta, 20), (b[13:], tb, 13)]),
            step(model, caches, backend, [([17], ta, len(a)), ([18], tb, len(b))]),
            step(model, caches, backend, [([19], ta, len(a) + 1), ([20], tb, len(b) + 1)]),
        ]
    for got, want in zip(hidden["triton"], hidden["torch"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_decode_matches_eager(model_dir):
    from prefixgate.backend.cuda_graphs import DecodeGraphRunner
    model, cfg = load_model(model_dir, device="cuda")
    shape = (12, 16, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.zeros(shape, device="cuda"), torch.zeros(shape, device="cuda"))
              for _ in range(cfg.num_hidden_layers)]
    graphs = DecodeGraphRunner(model, caches, block_size=16, max_num_seqs=8, max_blocks_per_seq=4)
    tables = [[5, 2, 9], [7, 1], [3]]
    prompts = [SHARED, SHARED[:20], SHARED[:9]]
    step(model, caches, "triton", [(p, t, 0) for p, t in zip(prompts, tables)])
    for i in range(3):   # 3 sequences replay the batch-4 graph with one padding row
        chunks = [([30 + i], t, len(p) + i) for p, t in zip(prompts, tables)]
        eager = step(model, caches, "triton", chunks)
        ids = torch.tensor([c[0][0] for c in chunks], device="cuda")
        pos = torch.tensor([c[2] for c in chunks], device="cuda")
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([t[s // 16] * 16 + s % 16 for (_, t, s) in chunks],
                                      device="cuda"),
            block_tables=torch.tensor([t + [0] * (3 - len(t)) for t in tables],
                                      dtype=torch.int32, device="cuda"),
            seq_lens=torch.tensor([s + 1 for (_, _, s) in chunks], dtype=torch.int32,
                                  device="cuda"),
            query_start_loc=torch.arange(4, dtype=torch.int32, device="cuda"), max_seq_len=0,
            is_decode=True)
        assert graphs.can_run(meta)
        torch.testing.assert_close(graphs.run(ids, pos, meta), eager, atol=1e-4, rtol=1e-4)


def test_cuda_graphs_refuse_what_cannot_be_captured(model_dir):
    """The reference path reads lengths on the host and CPU tensors have no graphs: both are
    refused up front (the model runner then runs eagerly) instead of failing mid-capture."""
    from prefixgate.backend.cuda_graphs import DecodeGraphRunner, default_batch_sizes
    model, cfg = load_model(model_dir)
    caches = [(torch.zeros(4, 16, cfg.num_key_value_heads, cfg.head_dim),) * 2]
    with pytest.raises(ValueError, match="Triton"):
        DecodeGraphRunner(model, caches, block_size=16, max_num_seqs=4, max_blocks_per_seq=4,
                          attention_backend="torch")
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphRunner(model, caches, block_size=16, max_num_seqs=4, max_blocks_per_seq=4)
    assert default_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
