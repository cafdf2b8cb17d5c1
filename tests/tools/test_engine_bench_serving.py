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
