"""The fleet simulator's exact-index policy: engine KV events, gateway replicas, the oracle."""
from __future__ import annotations

import json

import pytest

from prefixgate.backend.block_manager import BlockManager
from prefixgate.common.block_hash import block_hash_chain
from prefixgate.plugins.prefix_route.kv_index import Removed, Stored, decode_batch
from prefixgate.plugins.sim import index_bench, route_bench
from prefixgate.plugins.sim.engine_events import encode, record
from prefixgate.plugins.sim.fleet_sim import CostModel, FleetSim, rate_for
from prefixgate.plugins.sim.fleet_trace import SyntheticTrace, TraceConfig
from prefixgate.plugins.sim.route_indexes import CacheOracle, EventFedIndex, install
from tests.engine.test_block_manager import computed as cached_prompt

BS = 4


def test_engine_events_reach_the_gateway_as_the_block_manager_caches():
    bm = BlockManager(num_blocks=4, block_size=BS)
    sink = record(bm)
    first = list(range(100, 114))                          # 3 full blocks and 2 tokens
    bm.free(cached_prompt(bm, first))
    [stored] = decode_batch(encode(sink.take(), ts=1.0))
    chain = block_hash_chain(first, BS)
    assert stored == Stored(chain, None, first[:12], BS, None, "GPU",    # the root's parent: None
                            None, [None] * 3, "full_attention")
    bm.free(cached_prompt(bm, list(range(500, 514))))      # 4 blocks: 3 cached ones are reused
    events = decode_batch(encode(sink.take(), ts=2.0))
    removed = [h for e in events if isinstance(e, Removed) for h in e.block_hashes]
    assert sorted(removed) == sorted(set(chain) - set(bm.cached))
    assert len(removed) == 3 and all(e.medium == "GPU" for e in events)


def small_trace(requests=600) -> tuple[TraceConfig, CostModel]:
    cost = CostModel(kv_blocks=512)                        # small: blocks are evicted often
    t = TraceConfig(requests=requests, seed=4, system_prompts=40, docs=100,
                    long_tokens=(2000, 4000))
    t.rate = rate_for(0.8, 4, cost, t)
    return t, cost


def test_each_replicas_exact_index_holds_what_the_block_managers_hold():
    t, cost = small_trace()
    sim = FleetSim(4, "exact", t, cost, replicas=3, balancer="random")
    sim.run()
    truth = CacheOracle({name: b.bm for name, b in sim.backends.items()})
    chains = [c for r in SyntheticTrace(t) for c in (r.chain, r.history_chain) if c]
    for index in sim.event_indexes:
        evicted = 0
        for name, b in sim.backends.items():
            assert index.size(name) == len(b.bm.cached)
            evicted += index.engines[name].stored - index.size(name)
        assert evicted > 1000                   # the run did evict, so BlockRemoved mattered
        assert all(index.match(c) == truth.match(c) for c in chains)


def test_without_delay_the_exact_index_routes_as_the_oracle():
    t, cost = small_trace(400)
    exact = FleetSim(4, "exact", t, cost, event_delay_s=0).run()
    oracle = FleetSim(4, "oracle", t, cost).run()
    keys = ("hit_rate", "ttft_p95_s", "load_max_mean_requests")
    assert [exact[k] for k in keys] == [oracle[k] for k in keys]
    assert exact["kv_events"] > 0 and oracle["kv_events"] == 0


@pytest.fixture(scope="module")
def quick_bench(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "indexes.json"
    assert route_bench.main(["--scenario", "indexes", "--quick", "--out", str(path)]) == 0
    return json.loads(path.read_text())


MARGIN = 0.96         # of the oracle's hit rate; an index that misses evictions gets ~0.9


def test_quick_bench_saves_its_config_and_results(quick_bench):
    s = quick_bench["settings"]
    assert s["quick"] and s["backends"] == 8 and s["replicas"] == [1, 8]
    assert s["cost"]["kv_blocks"] == 2048 and s["trace"]["requests"] == 2000
    rows = {(r["row"], r["replicas"]) for r in quick_bench["results"]}
    assert rows == {(row, n) for row in index_bench.POLICIES for n in (1, 8)}


def test_with_8_replicas_exact_keeps_up_with_the_oracle_and_approximate_falls(quick_bench):
    one, eight = quick_bench["summary"]["1"], quick_bench["summary"]["8"]
    assert eight["exact"]["of_oracle"] >= MARGIN
    assert eight["exact"]["hit_rate"] >= 1.15 * eight["approximate"]["hit_rate"]
    assert eight["approximate"]["hit_rate"] < one["approximate"]["hit_rate"] - 0.1
    assert eight["round_robin"]["hit_rate"] < eight["approximate"]["hit_rate"]


class MissesEvictions(EventFedIndex):
    def apply(self, name, events):
        super().apply(name, [e for e in events if not isinstance(e, Removed)])


class FedNothing(EventFedIndex):
    def apply(self, name, events):
        pass


@pytest.mark.parametrize("broken", [MissesEvictions, FedNothing])
def test_a_stale_or_unfed_index_falls_below_that_margin(quick_bench, broken):
    trace, cost = index_bench.workload(None, True, 0)
    trace.rate = rate_for(index_bench.LOAD, 8, cost, trace)
    sim = FleetSim(8, "exact", trace, cost, replicas=8, shared_load=True, balancer="random",
                   measure_agreement=False)
    sim.event_indexes = [broken(sim.bt, cost.kv_blocks) for _ in sim.gws]
    for gw, index in zip(sim.gws, sim.event_indexes):
        install(gw, index)
    oracle = quick_bench["summary"]["8"]["oracle"]["hit_rate"]
    assert sim.run()["hit_rate"] < MARGIN * oracle
