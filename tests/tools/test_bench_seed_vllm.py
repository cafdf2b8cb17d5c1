"""`prefixgate bench --scenario seed --engine vllm`: each stage's vLLM flags (the stages run
over real vLLM in tests/vllm/test_bench_seed_vllm.py)."""
from __future__ import annotations

from prefixgate.proxy.bench import seed, vllm_fleet


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
