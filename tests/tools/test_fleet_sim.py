"""The fleet simulator: invariants on a small fleet (the budgets live in the benchmark)."""
from __future__ import annotations

import json

import pytest

from prefixgate.plugins.sim.fleet_sim import CostModel, FleetSim, main, rate_for
from prefixgate.plugins.sim.fleet_trace import SyntheticTrace, TraceConfig

COST = CostModel(kv_blocks=2048)


def trace(requests=800, seed=3) -> TraceConfig:
    t = TraceConfig(requests=requests, seed=seed, system_prompts=30, docs=200,
                    long_tokens=(4000, 8000))
    t.rate = rate_for(1.0, 4, COST, t)
    return t


@pytest.fixture(scope="module")
def results():
    t = trace()
    out = {}
    for policy in ("round_robin", "least_inflight", "chwbl", "cache_aware"):
        sim = FleetSim(4, policy, t, COST)
        out[policy] = (sim.run(), sim)
    return out


def test_no_policy_beats_the_oracle(results):
    for r, _ in results.values():
        assert 0 < r["hit_rate"] <= r["oracle_hit_rate"] + 1e-9
        assert r["requests"] == 800


def test_affinity_policies_hit_more_than_round_robin(results):
    rr = results["round_robin"][0]["hit_rate"]
    assert results["chwbl"][0]["hit_rate"] > rr
    assert results["cache_aware"][0]["hit_rate"] > rr


def test_the_engine_block_managers_did_the_counting(results):
    for r, sim in results.values():
        hits = sum(b.bm.prefix_hits for b in sim.backends.values())
        assert hits == sim.hit_tokens
        assert sum(b.served for b in sim.backends.values()) == r["requests"]
        assert all(u.inflight == 0 for u in sim.gw.upstreams)     # every request finished
        assert all(b.running == 0 and not b.queue for b in sim.backends.values())


def test_chwbl_respects_its_load_bound_in_flight(results):
    r = results["chwbl"][0]
    assert r["load_max_mean_requests"] < 1.6


def test_same_seed_same_result():
    a = FleetSim(3, "cache_aware", trace(300), COST).run()
    b = FleetSim(3, "cache_aware", trace(300), COST).run()
    keys = ("hit_rate", "oracle_hit_rate", "ttft_p95_s", "load_max_mean_requests")
    assert [a[k] for k in keys] == [b[k] for k in keys]


def test_trace_sessions_extend_their_history():
    reqs = list(SyntheticTrace(TraceConfig(requests=400, seed=5, rate=2.0, think_s=1.0,
                                           mix=(("chat", 1.0),))))
    by_prefix = 0
    for i, r in enumerate(reqs):
        later = [x for x in reqs[i + 1:] if len(x.tokens) > len(r.tokens) + len(r.output)
                 and (x.tokens[:len(r.tokens)] == r.tokens).all()]
        if later:
            by_prefix += 1
            nxt = later[0]
            n = len(r.tokens) + len(r.output)
            assert (nxt.tokens[len(r.tokens):n] == r.output).all()    # the answer is in it
            assert nxt.chain[:len(r.chain)] == r.chain
    assert by_prefix > 200          # ~3 of 4 turns have a next turn (4 turns on average)


def test_cli_saves_json(tmp_path):
    path = tmp_path / "sim.json"
    assert main(["--backends", "2", "--requests", "200", "--kv-blocks", "1024",
                 "--policies", "round_robin,chwbl", "--json", str(path)]) == 0
    saved = json.loads(path.read_text())
    assert [r["policy"] for r in saved["results"]] == ["round_robin", "chwbl"]
    assert saved["settings"]["cost"]["kv_blocks"] == 1024


def test_replicas_agree_when_they_share_the_load_view():
    shared = FleetSim(4, "chwbl", trace(400), COST, replicas=2, shared_load=True).run()
    local = FleetSim(4, "chwbl", trace(400), COST, replicas=2).run()
    assert shared["replica_agreement"] >= 0.99
    assert 0 < local["replica_agreement"] <= 1
    assert shared["requests"] == local["requests"] == 400


def test_polling_replicas_read_every_backends_own_counts():
    # --poll-metrics-s: each replica scrapes every backend on the simulated clock, as
    # prefix_route's LoadPoller does, and its scorers read those samples
    sim = FleetSim(4, "predicted_ttft", trace(400), COST, replicas=2, poll_metrics_s=0.05)
    result = sim.run()
    assert result["poll_metrics_s"] == 0.05 and result["requests"] == 400
    end = sim.now
    for gw, poller in zip(sim.gws, sim.pollers):
        sim.now = end
        assert all(u.polled is poller for u in gw.upstreams)
        assert set(poller.samples) == {u.name for u in gw.upstreams}
        assert all(0 < s.t <= end for s in poller.samples.values())
        # read on the simulation's clock: fresh just after the last poll (polls stop with the
        # arrivals), stale once the backends drained on
        last = max(s.t for s in poller.samples.values())
        up = gw.upstreams[0]
        assert poller.waiting(up) is None and sim.now - last > poller.stale_after_s
        sim.now = last + 0.01
        assert poller.waiting(up) == poller.samples[up.name].waiting
    assert FleetSim(4, "predicted_ttft", trace(400), COST, replicas=2).pollers == []
