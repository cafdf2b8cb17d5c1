"""The engine benchmark script runs end to end (on a tiny model, one repeat) and saves its JSON."""
import json

from model_factory import make_tiny_model
from prefixgate.backend import bench


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
