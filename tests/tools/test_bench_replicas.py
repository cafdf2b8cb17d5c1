"""`prefixgate bench --scenario replicas` (issue #42's evaluation) on real parts: two bundled
engines (the demo model), the gateway as `prefixgate serve --upstream A --upstream B` builds it,
one replica or three behind the round-robin TCP balancer, a connection per request."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from prefixgate.proxy.bench import cli as bench
from prefixgate.proxy.bench import replicas
from prefixgate.proxy.bench.prompts import Lengths, load_tokenizer
from prefixgate.proxy.cli import DEFAULT_POLICY, POLICIES
from tests.tools.helpers import run_cli


async def test_quick_run_measures_every_mode_through_independent_replicas(tmp_path):
    out = tmp_path / "replicas.json"
    rc, stdout, stderr = await run_cli("bench", "--scenario", "replicas", "--quick",
                                       "--out", str(out))
    assert rc == 0, stderr[-2000:]
    archive = json.loads(out.read_text())
    w = archive["config"]["workload"]
    sent = w["warmup"] + w["requests"]
    assert archive["config"]["git"]["head"]
    cells = {c["mode"]: c for c in archive["cells"]}
    assert list(cells) == list(replicas.MODES)
    for mode, c in cells.items():
        s = c["summary"]
        assert s["requests"] == w["requests"] and s["errors"] == 0, (mode, s)
        assert 0.0 <= c["cached_share"] <= 1.0 and c["cached_share"] > 0.3, (mode, c)
        assert sum(c["upstreams"].values()) == w["requests"]
        assert set(c["upstreams"]) <= {"engine0", "engine1"}
        assert 0.5 <= c["agreement"] <= 1.0
        assert all(s[f"ttft_p{q}_ms"] > 0 for q in (50, 95, 99))
        # each replica is a gateway of its own: its own /metrics counted its share of the
        # requests, and together they counted every request sent (warm-up included)
        (counted,) = c["replica_requests"]
        assert len(counted) == replicas.MODES[mode].replicas
        assert sum(counted) == sent and min(counted) >= sent // 3 - 1
        # the config is the command line's (`--policy P`, else its default), the upstreams
        # only named and the timeouts set by the bench; no tokenizer, as the default has none
        policy = replicas.MODES[mode].policy or DEFAULT_POLICY
        assert c["gateway"]["plugins"] == [POLICIES[policy], {"metrics": {}}]
        assert [u["name"] for u in c["gateway"]["upstreams"]] == ["engine0", "engine1"]
        assert "models" not in c["gateway"]
    assert cells["round-robin-3"]["routes"] == {}
    assert cells["default-3"]["routes"] and cells["default-1"]["routes"]
    cmp = archive["comparison"]
    assert cmp["scarce"] and set(cmp["three_vs_one"]["met"]) == {"cached_share_ratio",
                                                                "p95_ratio"}
    assert cmp["vs_round_robin"]["default-3"]["target"] == replicas.TARGET_VS_RR_SCARCE
    assert "target" not in cmp["vs_round_robin"]["chwbl-3"]
    assert "| default-3 | 3 |" in stdout and "default-3 / default-1: cached share" in stdout


def test_tenants_prompts_and_kv_room_follow_the_workload():
    w = replicas.ReplicasWorkload()
    prompts = replicas.TenantPrompts(w, Lengths(load_tokenizer("demo")))
    built = prompts.built()
    # ~2,000 tokens each as the chat template renders the system message, distinct from the
    # first token on; Zipf(1.1) popularity, the first tenant the most popular
    assert all(abs(n - w.system_tokens) <= 4 for n in built["system_tokens_built"])
    tok = prompts.lengths.tokenizer
    assert len({tok.encode(s)[0] for s in prompts.systems}) == w.tenants
    assert built["tenant_popularity"] == sorted(built["tenant_popularity"], reverse=True)
    requests = prompts.round(0)
    assert len(requests) == w.warmup + w.requests
    drawn = Counter(t for t, _ in requests)
    assert drawn[0] == max(drawn.values()) and len(drawn) >= 6
    assert prompts.round(0)[5] == requests[5] and prompts.round(1)[5] != requests[5]
    # KV for 3/4 of the 8 prefixes (125 blocks each) beside 6 requests' own blocks (the
    # question, the template's tokens and the answer: 8 blocks)
    assert w.kv_blocks() == 750 + 6 * 8
    assert replicas.ReplicasWorkload(kv_share=2.0).kv_blocks() == 2000 + 6 * 8


@pytest.mark.parametrize("flag", [["--kv-share", "2"], ["--modes", "default-1"],
                                  ["--client", "vllm"]])
def test_the_replicas_flags_are_for_the_replicas_scenario(flag, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--url", "http://127.0.0.1:9", *flag])
    assert e.value.code == 2
    assert "are for --scenario replicas" in capsys.readouterr().err
