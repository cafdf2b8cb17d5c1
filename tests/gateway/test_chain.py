"""The plugin chain: scorers pick upstreams; /v1/models, /health, /metrics."""
from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
from collections import Counter

import aiohttp

from tests.helpers import CHAT


async def chat(client, url, **extra):
    async with client.post(url + "/v1/chat/completions", json={**CHAT, **extra}) as r:
        await r.read()
        return r.status, r.headers.get("x-prefixgate-upstream")


async def test_round_robin_alternates(make_standin, make_gateway):
    a, b = await make_standin(), await make_standin()
    gw = await make_gateway({"upstreams": [{"name": "a", "url": a.url},
                                           {"name": "b", "url": b.url}],
                             "plugins": ["round_robin"]})
    async with aiohttp.ClientSession() as client:
        picks = [(await chat(client, gw.url))[1] for _ in range(10)]
    assert Counter(picks) == {"a": 5, "b": 5}
    assert all(picks[i] != picks[i + 1] for i in range(9))


async def test_least_inflight_avoids_the_busy_upstream(make_standin, make_gateway):
    a, b = await make_standin(), await make_standin()
    gw = await make_gateway({"upstreams": [{"name": "a", "url": a.url},
                                           {"name": "b", "url": b.url}],
                             "plugins": ["least_inflight"]})
    async with aiohttp.ClientSession() as client:
        busy = asyncio.create_task(chat(client, gw.url, x_standin={"first_delay": 1.5}))
        await asyncio.sleep(0.2)           # the slow request now holds one upstream
        picks = [(await chat(client, gw.url))[1] for _ in range(5)]
        held = (await busy)[1]
    assert set(picks) == {"b" if held == "a" else "a"}


async def test_weighted_scorers_compose(make_standin, make_gateway):
    a, b = await make_standin(), await make_standin()
    # round robin (weight 1) alternates; least_inflight (weight 1) is a tie when idle
    gw = await make_gateway({"upstreams": [{"name": "a", "url": a.url},
                                           {"name": "b", "url": b.url}],
                             "plugins": [{"round_robin": {"weight": 1}},
                                         {"least_inflight": {"weight": 0.5}}]})
    async with aiohttp.ClientSession() as client:
        picks = [(await chat(client, gw.url))[1] for _ in range(8)]
    assert Counter(picks) == {"a": 4, "b": 4}


async def test_models_are_merged_from_all_upstreams(make_standin, make_gateway):
    a, b = await make_standin(model="llama"), await make_standin(model="qwen")
    c = await make_standin(model="llama")
    gw = await make_gateway({"upstreams": [{"name": n, "url": s.url} for n, s in
                                           (("a", a), ("b", b), ("c", c))]})
    async with aiohttp.ClientSession() as client:
        async with client.get(gw.url + "/v1/models") as r:
            body = await r.json()
    assert r.status == 200 and body["object"] == "list"
    assert sorted(m["id"] for m in body["data"]) == ["llama", "qwen"]


async def test_health_and_metrics(make_standin, make_gateway):
    up = await make_standin(tokens=5, gap=0.01)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url}],
                             "plugins": [{"metrics": {"slo_ttft_ms": 1000}}]})
    async with aiohttp.ClientSession() as client:
        async with client.get(gw.url + "/health") as r:
            assert r.status == 200 and (await r.json())["upstreams"]["a"]["healthy"] is True
        for _ in range(3):
            assert (await chat(client, gw.url, stream=True))[0] == 200
        async with client.post(gw.url + "/v1/chat/completions", data=b"{") as r:
            assert r.status == 400
        async with client.get(gw.url + "/metrics") as r:
            text = await r.text()
            assert r.headers["Content-Type"].startswith("text/plain")

    def value(name):
        return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))

    assert value('prefixgate_requests_total{model="standin-model",status="200"}') == 3
    assert value('prefixgate_requests_total{model="",status="400"}') == 1     # no model read
    for stage in ("gateway", "queue", "connect", "upstream_ttft"):   # the TTFT breakdown
        assert value(f'prefixgate_stage_seconds_count{{stage="{stage}"}}') == 3
    assert value('prefixgate_ttft_seconds_count{upstream="a"}') == 3
    assert value('prefixgate_tpot_seconds_count{upstream="a"}') == 3
    assert value("prefixgate_goodput_total") == 3
    assert value('prefixgate_inflight{upstream="a"}') == 0
    assert value('prefixgate_upstream_connect_seconds_count{upstream="a"}') >= 1


async def test_prefixgate_serve_end_to_end(make_standin, tmp_path):
    up = await make_standin(tokens=3)
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: 0}}\n"
                   f"upstreams:\n  - {{name: a, url: '{up.url}'}}\nplugins: [metrics]\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prefixgate.proxy.cli", "serve", "--config", str(cfg),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        url = re.search(r"listening on (http://\S+)", line).group(1)
        async with aiohttp.ClientSession() as client:
            assert (await chat(client, url, stream=True)) == (200, "a")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0


async def test_upstreams_join_and_leave_without_a_restart(make_standin, make_gateway):
    a, b = await make_standin(), await make_standin(tokens=50, gap=0.02)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": a.url}],
                             "plugins": ["round_robin"]})
    cfg_a = gw.gateway.upstreams[0].cfg
    cfg_b = {**cfg_a, "name": "b", "url": b.url}
    await gw.gateway.set_upstreams([cfg_a, cfg_b])
    async with aiohttp.ClientSession() as client:
        assert Counter([(await chat(client, gw.url))[1] for _ in range(4)]) == {"a": 2, "b": 2}
        # b leaves while streaming: its stream finishes, new requests go to a only
        async with client.post(gw.url + "/v1/chat/completions",
                               json={**CHAT, "stream": True, "x_standin": {"gap": 0.02}}) as r:
            leaving = r.headers["x-prefixgate-upstream"]
            keep = cfg_a if leaving == "b" else cfg_b
            await gw.gateway.set_upstreams([keep])
            body = await r.read()
        assert body.endswith(b"data: [DONE]\n\n")
        assert {(await chat(client, gw.url))[1] for _ in range(3)} == {keep["name"]}
