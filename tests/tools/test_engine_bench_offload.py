"""The second-tier benchmark runs end to end (tiny model, --quick) and saves its JSON."""
import json

from prefixgate.backend.bench import offload as bench_kv_tier
from prefixgate.proxy.bench import seed as bench_seed


def test_bench_kv_tier_quick_run_serves_revisits_from_the_tier(tmp_path, capsys, model):
    out = tmp_path / "tier.json"
    argv = ["--quick", "--model", str(model), "--prefix-tokens", "64", "--suffix-tokens", "8",
            "--block-size", "4", "--kv-offloading-size", "0.01", "--out", str(out)]
    assert bench_kv_tier.main(argv) == 0
    data = json.loads(out.read_text())
    off, on = data["arms"]["off"], data["arms"]["on"]
    assert off["revisits"] == on["revisits"] == 4
    # the device cache holds 2 of the 4 prefixes; the tier holds them all
    assert data["device_blocks"] == 2 * 16 + 4
    assert on["counters"]["kv_offload_loaded_blocks"] > 0
    assert on["counters"]["kv_offload_hit_tokens"] > 0 and on["tier_fraction"] > 0
    assert off["counters"]["kv_offload_loaded_blocks"] == 0
    assert on["cached_fraction"] > off["cached_fraction"]
    assert data["p50_ratio"] > 0 and data["p95_ratio"] > 0
    printed = capsys.readouterr().out
    assert "with the tier" in printed and "TTFT p50 without / with" in printed


def test_seed_staircase_adds_the_tier_after_affinity_routing():
    names = [s.name for s in bench_seed.STAGES]
    tier = bench_seed.STAGES[names.index("+KV offload tier")]
    before = bench_seed.STAGES[names.index("+KV offload tier") - 1]
    pd = bench_seed.STAGES[names.index("+PD disaggregation")]
    assert before.name == "+affinity routing" and not before.kv_offload
    assert tier.routing == "prefix_route" and not tier.pd
    assert pd.kv_offload and names.index("+PD disaggregation") > names.index("+KV offload tier")
    w = bench_seed.Workload()
    args = tier.engine_args(w)
    assert args[args.index("--kv-offloading-size") + 1] == str(w.kv_offloading_size)
    assert "--kv-offloading-size" not in before.engine_args(w)
