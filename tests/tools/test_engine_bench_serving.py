"""The engine benchmark script runs end to end (on a tiny model, one repeat) and saves its JSON."""
import json

from prefixgate.backend.bench import serving as bench
from tests.helpers import make_tiny_model


def test_bench_script_runs_and_saves_json(tmp_path, capsys):
    model = make_tiny_model(tmp_path / "m", "llama", max_position_embeddings=8192)
    out = tmp_path / "bench.json"
    assert bench.main(["--model", str(model), "--repeats", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    for part, ratio in (("prefix_cache", "prefix_50"), ("prefix_cache", "prefix_80"),
                        ("chunked_prefill", "chunked_p95"), ("continuous_batching", "throughput")):
        assert data[part][ratio] > 0
    assert data["config"]["repeats"] == 1
    printed = capsys.readouterr().out
    assert "a) prefix cache" in printed and "c) 16 x 128 tokens" in printed


def test_bench_part_d_starts_fresh_engines_with_and_without_warmup(tmp_path, capsys, model):
    out = tmp_path / "bench.json"
    argv = ["--model", str(model), "--parts", "d", "--repeats", "1", "--out", str(out)]
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())["warmup"]
    assert set(data["medians"]) == {"mmap_warm", "mmap_skip", "eager_warm", "eager_skip"}
    for m in data["medians"].values():
        assert (0 < m["listening_s"] <= m["ready_s"] and m["first_ttft_s"] > 0
                and m["second_ttft_s"] > 0)
    assert set(data["first_ttft_skip_over_warm"]) == {"mmap", "eager"}
    assert "d) fresh engine processes" in capsys.readouterr().out


def test_prefill_flops_count_every_layer_weight_and_query_key_pair(model):
    from prefixgate.backend.bench.flops import PrefillFlops
    from prefixgate.backend.loader import load_model

    _, c = load_model(model)
    flops = PrefillFlops.of(c)
    h, d, heads, kv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    per_layer = (h * heads * d + 2 * h * kv * d + heads * d * h      # q, k, v, o
                 + 3 * h * c.intermediate_size + 2 * h)              # the MLP, two norms
    assert flops.layer_params == c.num_hidden_layers * per_layer
    # token by token: every layer's weights once, attention to itself and every key before it
    new, cached = 50, 70
    by_token = sum(2 * flops.layer_params + 4 * d * heads * c.num_hidden_layers * (cached + i + 1)
                   for i in range(new)) + 2 * c.vocab_size * h
    assert flops(new, cached) == by_token
    assert flops.hit_limit(120, 70) == flops(120) / by_token
    assert 1 < flops.hit_limit(120, 60) < flops.hit_limit(120, 96) < 120 / 24


def test_parts_c_e_f_run_on_a_gguf_model(tmp_path, capsys, model):
    from prefixgate.backend.bench.flops import PrefillFlops
    from prefixgate.backend.loader import load_model
    from tests.engine.gguf_writer import Q, write_gguf

    gguf = write_gguf(model, tmp_path / "tiny.gguf", Q.F16)
    out = tmp_path / "bench.json"
    argv = ["--model", str(gguf), "--parts", "c,e,f", "--tiers", "64,200",
            "--decode-batches", "1,3", "--repeats", "1", "--out", str(out)]
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    # c: transformers' baseline loaded the same GGUF
    assert data["continuous_batching"]["transformers_s"] > 0
    tiers = data["prompt_lengths"]["tiers"]
    assert set(tiers) == {"64", "200"}
    # the cache keeps whole blocks (16 tokens): of 160 prompt tokens served before, 160 count
    # at 200 tokens, 48 at 64 (51 served)
    flops = PrefillFlops.of(load_model(gguf)[1])
    assert tiers["200"]["flop_limit"]["80"] == flops.hit_limit(200, 160)
    assert tiers["64"]["flop_limit"]["80"] == flops.hit_limit(64, 48)
    for t in tiers.values():
        assert t["ttft_median_s"]["cold"] > 0 and t["speedup"]["80"] > 0
    decode = data["decode"]["batches"]
    assert set(decode) == {"1", "3"}
    for b, d in decode.items():
        assert d["tpot_p50_s"] > 0 and d["tok_per_s"] == int(b) / d["tpot_p50_s"]
    printed = capsys.readouterr().out
    assert "e) TTFT by prompt length" in printed and "f) decode" in printed
