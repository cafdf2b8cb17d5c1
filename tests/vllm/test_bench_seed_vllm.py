"""`prefixgate bench --scenario seed --engine vllm` over real vLLM: the affinity stage (the
gateway routing by vLLM's own KV events) and SGLang Model Gateway's `cache_aware`, measured over
the session's two vLLM servers (`vllm_pair`; a full run starts servers per stage with the
stage's flags: tests/tools/test_bench_seed_vllm.py checks those)."""
from __future__ import annotations

import pytest

from prefixgate.proxy.bench import cli as bench
from prefixgate.proxy.bench import seed, vllm_fleet
from prefixgate.proxy.bench.prompts import Lengths, load_tokenizer
from tests.tools.test_bench_seed_vllm import stage

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

WORKLOAD = dict(prompt_tokens=400, tenants=2, requests=4, warmup=2, concurrency=2,
                think_ms=300, max_tokens=2, rounds=1)


class PairEngines:
    """The session's servers in the shape the fleet's stages read."""

    def __init__(self, pair):
        self.urls = [s.url for s in pair]
        self.kv_events = [s.kv_events for s in pair]
        self.model_dir = pair[0].model_dir


class Running:
    """Servers already started, handed to each stage as if started for it (stopped by the
    fixture)."""

    def __init__(self, engines):
        self.urls, self.kv_events = engines.urls, engines.kv_events
        self.model_dir = engines.model_dir

    async def start(self):
        pass

    async def stop(self):
        pass


class SharedFleet(vllm_fleet.VLLMFleet):
    """The vLLM fleet with every stage on the same running servers."""

    def __init__(self, engines, log_dir):
        super().__init__(log_dir)
        self.engines = engines

    def launcher_for(self, stage, w):
        return lambda cfg: Running(self.engines)


@pytest.fixture
def servers(vllm_pair, tmp_path):
    w = seed.Workload(**WORKLOAD, block_size=128, index="kv_events")
    return SharedFleet(PairEngines(vllm_pair), tmp_path), w


async def test_affinity_and_sglang_run_over_real_vllm(servers, capsys):
    fleet, w = servers
    engines = fleet.engines
    args = bench.parse_args(["--scenario", "seed", "--model", "smollm2"])
    archive = await seed.run_stages(w, [stage("+affinity routing"), stage(vllm_fleet.SGLANG)],
                                    Lengths(load_tokenizer("smollm2")), args, fleet=fleet)
    fleet.report(archive)
    routed, sglang = archive["cells"]
    assert archive["config"]["engine"] == "vllm"
    for cell in archive["cells"]:
        assert cell["summary"]["requests"] == 4 and cell["summary"]["errors"] == 0, cell["label"]
        assert seed.cached_share(cell) is not None          # usage relayed with cached tokens
    # normalized, each tenant's prefix comes back from the cache (two tenants, six requests)
    assert seed.cached_share(routed) > 0
    plugins = routed["gateway"]["plugins"]
    assert {"prerender": {}} in plugins and plugins[2]["prefix_route"]["index"] == "kv_events"
    assert routed["gateway"]["models"]["smollm2"]["tokenizer"] == str(engines.model_dir)
    # vLLM's own events fed the exact index, and the router chose by it
    assert routed["kv_events"]["batches"] > 0 and routed["kv_events"]["malformed"] == 0
    assert routed["routes"].get("cache", 0) > 0
    assert sum(e["prefix_hits"] for e in routed["engines"]) > 0
    router = sglang["gateway"]["router"]
    assert router[router.index("--policy") + 1] == "cache_aware"
    assert router[-2:] == engines.urls
    assert sum(e["prefix_queries"] for e in sglang["engines"]) > 0
    out = capsys.readouterr().out
    assert "routers over the same two vLLM servers" in out
    assert {line.split()[0] for line in out.splitlines()[-2:]} == {"SGLang", "prefixgate"}
