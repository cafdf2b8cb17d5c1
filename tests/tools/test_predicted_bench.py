"""predicted_ttft in the fleet simulator, on mixed hardware: the scorer the gateway runs, fed
the simulated answers (the budgets live in the benchmark, `route_bench --scenario predicted`)."""
from __future__ import annotations

import json

import pytest

from prefixgate.plugins.sim import predicted_bench, route_bench
from prefixgate.plugins.sim.fleet_sim import CostModel, FleetSim, rate_for
from prefixgate.plugins.sim.fleet_trace import TraceConfig

COST = CostModel()        # KV enough for the trace: prefill speed, not KV space, binds
SPEEDS = [1.0, 1.0, 0.5, 0.5]


@pytest.fixture(scope="module")
def sims():
    t = TraceConfig(requests=1500, seed=3, system_prompts=30, docs=200, long_tokens=(4000, 8000))
    t.rate = rate_for(1.0, sum(SPEEDS), COST, t)
    out = {}
    for policy in ("round_robin", "cache_aware", "predicted_ttft"):
        sim = FleetSim(len(SPEEDS), policy, t, COST, speeds=SPEEDS)
        out[policy] = (sim.run(), sim)
    return out


def test_the_half_speed_backends_prefill_at_half_speed(sims):
    _, sim = sims["round_robin"]
    rates = [b.prefill_tokens_per_s for b in sim.backends.values()]
    assert rates == [COST.prefill_tokens_per_s * s for s in SPEEDS]


def test_predicted_ttft_learns_the_speeds_and_predicts_within_a_quarter(sims):
    r, sim = sims["predicted_ttft"]
    assert r["requests"] == 1500 and all(u.inflight == 0 for u in sim.gw.upstreams)
    assert r["prediction_error_p50"] < 0.25
    route = next(p for p in sim.gw.chain.plugins if p.name == "prefix_route")
    learned = {name: fit.tokens_per_s for name, fit in route.predicted.model.of(None).items()}
    fast = min(learned[f"b{i}"] for i, s in enumerate(SPEEDS) if s == 1.0)
    slow = max(learned[f"b{i}"] for i, s in enumerate(SPEEDS) if s == 0.5)
    assert 1.6 < fast / slow < 2.4
    assert not any(lane.pending for lane in route.predicted.queue.lanes.values())


def test_predicted_ttft_keeps_affinity_and_cuts_the_tail(sims):
    rr, ca, pt = (sims[p][0] for p in ("round_robin", "cache_aware", "predicted_ttft"))
    assert pt["hit_rate"] > rr["hit_rate"]
    assert pt["hit_rate"] >= 0.9 * ca["hit_rate"]
    assert pt["ttft_p95_s"] < ca["ttft_p95_s"]


def test_the_predicted_scenario_prints_and_saves_its_table(tmp_path, capsys):
    path = tmp_path / "predicted.json"
    assert route_bench.main(["--scenario", "predicted", "--requests", "300", "--upstreams", "16",
                             "--out", str(path)]) == 0
    out = capsys.readouterr().out
    saved = json.loads(path.read_text())
    rows = {(r["load"], r["policy"]) for r in saved["results"]}
    assert rows == {(load, p) for load in predicted_bench.LOADS for p in predicted_bench.POLICIES}
    assert "| 100% | predicted_ttft |" in out
    assert saved["pick"]["predicted_ttft"]["pick_us_p50"] > 0
    assert all(0 <= r["goodput"] <= 1 for r in saved["results"])
