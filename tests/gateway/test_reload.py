"""Hot reload (in process and by SIGHUP) and graceful shutdown on SIGTERM of `prefixgate serve`."""
from __future__ import annotations

import asyncio
import re
import signal
import time

import aiohttp
import pytest
import yaml

from prefixgate.common.schema import ConfigError
from prefixgate.proxy.config import gateway as config_mod
from tests.helpers import CHAT, event_json, read_events


async def stream(client, url, **standin):
    """A streamed chat; returns (upstream name, content events, saw [DONE])."""
    async with client.post(url + "/v1/chat/completions",
                           json={**CHAT, "stream": True, "x_standin": standin}) as r:
        assert r.status == 200, await r.text()
        events = [event_json(e) for _, e in await read_events(r)]
        return r.headers["x-prefixgate-upstream"], events


def contents(events) -> list[str]:
    return [e["choices"][0]["delta"].get("content") for e in events
            if isinstance(e, dict) and "choices" in e and e["choices"][0]["delta"].get("content")]


async def test_reload_swaps_upstreams_and_plugins_without_dropping_streams(make_standin,
                                                                          make_gateway):
    a, b = await make_standin(tokens=10, gap=0.05), await make_standin(tokens=10)
    raw = {"upstreams": [{"name": "a", "url": a.url}],
           "plugins": ["metrics", {"admission": {"max_inflight": 4}}]}
    gw = await make_gateway(raw)
    g = gw.gateway
    metrics_before = next(p for p in g.chain.plugins if p.name == "metrics")
    async with aiohttp.ClientSession() as client:
        inflight = asyncio.create_task(stream(client, gw.url))
        await asyncio.sleep(0.15)                            # mid-stream on a
        await g.reload(config_mod.validate(
            {"upstreams": [{"name": "b", "url": b.url}],
             "plugins": ["metrics", {"admission": {"max_inflight": 8}}]}))
        name, events = await inflight
        assert name == "a" and contents(events) == [f"tok{i} " for i in range(10)]
        assert events[-1] == "[DONE]"
        assert {(await stream(client, gw.url))[0] for _ in range(3)} == {"b"}
        async with client.get(gw.url + "/metrics") as r:
            text = await r.text()
    # the unchanged metrics plugin (and its counts) survived; admission was rebuilt
    assert next(p for p in g.chain.plugins if p.name == "metrics") is metrics_before
    assert 'prefixgate_requests_total{model="standin-model",status="200"} 4.0' in text
    assert next(p for p in g.chain.plugins if p.name == "admission").cfg["max_inflight"] == 8
    await asyncio.sleep(0.3)
    assert [u.name for u in g.upstreams] == ["b"]


async def test_bad_plugin_settings_are_refused_and_the_old_config_stays(make_standin,
                                                                       make_gateway):
    a = await make_standin()
    gw = await make_gateway({"upstreams": [{"name": "a", "url": a.url}], "plugins": ["metrics"]})
    g = gw.gateway
    chain, registry = g.chain, g.registry
    with pytest.raises(ConfigError, match=r"plugins\[0\].metrics.slo_ttft_ms"):
        await g.reload(config_mod.validate({"upstreams": [{"name": "z", "url": a.url}],
                                            "plugins": [{"metrics": {"slo_ttft_ms": -1}}]}))
    assert g.chain is chain and g.registry is registry and [u.name for u in g.upstreams] == ["a"]
    async with aiohttp.ClientSession() as client:
        assert (await stream(client, gw.url))[0] == "a"
        async with client.get(gw.url + "/metrics") as r:
            assert "prefixgate_ttft_seconds" in await r.text()


async def test_reload_turns_auth_on_and_keeps_rate_limit_state(make_standin, make_gateway):
    a = await make_standin()
    gw = await make_gateway({"upstreams": [{"name": "a", "url": a.url}]})
    limited = {"key": "sk-reload-key-1", "rate_limit": {"requests_per_minute": 6, "burst": 2}}
    cfg = {"upstreams": [{"name": "a", "url": a.url}], "auth": {"api_keys": [limited]}}
    await gw.gateway.reload(config_mod.validate(cfg))
    key = {"Authorization": "Bearer sk-reload-key-1"}
    async with aiohttp.ClientSession() as client:
        async def status(headers):
            async with client.post(gw.url + "/v1/chat/completions", json=CHAT,
                                   headers=headers) as r:
                return r.status
        assert await status({}) == 401
        assert await status(key) == 200
        await gw.gateway.reload(config_mod.validate(cfg))       # same key: bucket carried over
        assert [await status(key) for _ in range(2)] == [200, 429]


def write(path, cfg):
    path.write_text(yaml.safe_dump(cfg))


async def test_sighup_reloads_and_a_bad_file_is_refused(tmp_path, make_standin, serve_process):
    a, b = await make_standin(tokens=10, gap=0.05), await make_standin(tokens=10)
    path = tmp_path / "gw.yaml"
    base = {"listen": {"port": 0}, "health": {"interval_s": 0}}
    write(path, {**base, "upstreams": [{"name": "a", "url": a.url}]})
    gw = await serve_process(path)
    async with aiohttp.ClientSession() as client:
        inflight = asyncio.create_task(stream(client, gw.url))
        await asyncio.sleep(0.15)
        write(path, {**base, "upstreams": [{"name": "b", "url": b.url}]})
        gw.signal(signal.SIGHUP)
        assert await gw.wait_output("config reloaded")
        name, events = await inflight                        # the running stream finished
        assert name == "a" and len(contents(events)) == 10 and events[-1] == "[DONE]"
        assert (await stream(client, gw.url))[0] == "b"

        write(path, {**base, "upstreams": [{"name": "c", "url": "ftp://nowhere"}]})
        gw.signal(signal.SIGHUP)
        assert await gw.wait_output("config reload refused")
        assert any("upstreams[0].url: must start with http://" in line for line in gw.output)
        assert (await stream(client, gw.url))[0] == "b"      # the old config stays
        path.write_text("upstreams: [unclosed")
        gw.signal(signal.SIGHUP)
        assert await gw.wait_output("invalid YAML")
        assert (await stream(client, gw.url))[0] == "b"
    assert gw.proc.returncode is None


async def test_sigterm_drains_in_flight_streams_then_exits_0(tmp_path, make_standin,
                                                            serve_process):
    up = await make_standin(tokens=12, gap=0.1)
    path = tmp_path / "gw.yaml"
    write(path, {"listen": {"port": 0}, "upstreams": [{"url": up.url}],
                 "shutdown_timeout_s": 10, "admin_listen": {"port": 0},
                 "plugins": ["metrics"]})
    gw = await serve_process(path)
    admin = re.search(r"admin \(/metrics, /health\) on (http://\S+)", "".join(gw.output))
    async with aiohttp.ClientSession() as client:
        async with client.get(admin.group(1) + "/metrics") as r:
            assert r.status == 200 and "prefixgate_ttft_seconds" in await r.text()
        async with client.get(gw.url + "/metrics") as r:
            assert r.status == 404
        inflight = asyncio.create_task(stream(client, gw.url))
        await asyncio.sleep(0.3)
        gw.signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        with pytest.raises(aiohttp.ClientConnectionError):   # no longer accepting
            async with aiohttp.ClientSession() as fresh:
                await fresh.get(gw.url + "/health")
        _, events = await inflight
    assert len(contents(events)) == 12 and events[-1] == "[DONE]"
    assert await asyncio.wait_for(gw.proc.wait(), 10) == 0


async def test_sigterm_deadline_cuts_streams_that_run_too_long(tmp_path, make_standin,
                                                              serve_process):
    up = await make_standin(tokens=100, gap=0.1)            # a 10 s stream
    path = tmp_path / "gw.yaml"
    write(path, {"listen": {"port": 0}, "upstreams": [{"url": up.url}],
                 "shutdown_timeout_s": 0.5})
    gw = await serve_process(path)
    async with aiohttp.ClientSession() as client:
        inflight = asyncio.create_task(stream(client, gw.url))
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        gw.signal(signal.SIGTERM)
        assert await asyncio.wait_for(gw.proc.wait(), 10) == 0
        assert time.monotonic() - t0 < 3
        with pytest.raises((aiohttp.ClientError, AssertionError)):
            _, events = await inflight
            assert events[-1] == "[DONE]"


async def test_reload_keeps_dns_discovered_upstreams(make_standin, make_gateway):
    static, pod = await make_standin(), await make_standin()
    port = int(pod.url.rsplit(":", 1)[1])
    raw = {"upstreams": [{"name": "static", "url": static.url}],
           "discovery": {"dns": "pods.fleet.invalid", "port": port, "interval_s": 60}}
    gw = await make_gateway(raw)
    g = gw.gateway

    async def answers(host, port, family):
        return ["127.0.0.1"]
    g.discovery.resolver = answers
    assert await g.discovery.refresh()
    pod_name = f"127.0.0.1:{port}"
    assert sorted(u.name for u in g.upstreams) == [pod_name, "static"]
    # a reload that changes a static upstream keeps what DNS found ...
    await g.reload(config_mod.validate({**raw, "upstreams": [
        {"name": "static", "url": static.url, "max_inflight": 7}]}))
    assert sorted(u.name for u in g.upstreams) == [pod_name, "static"]
    assert next(u for u in g.upstreams if u.name == "static").max_inflight == 7
    # ... and one that changes discovery settings starts a new discovery
    old = g.discovery
    await g.reload(config_mod.validate({**raw, "discovery": {**raw["discovery"],
                                                             "interval_s": 30}}))
    assert g.discovery is not old and g.discovery.cfg["interval_s"] == 30
    assert [u.name for u in g.upstreams] == ["static"]   # the real lookup of *.invalid fails


async def test_sigusr1_reopens_the_access_log_of_a_running_serve(tmp_path, make_standin,
                                                                 serve_process):
    up = await make_standin()
    path, log = tmp_path / "gw.yaml", tmp_path / "access.log"
    write(path, {"listen": {"port": 0}, "health": {"interval_s": 0},
                 "upstreams": [{"name": "a", "url": up.url}],
                 "access_log": {"path": str(log)}})
    gw = await serve_process(path)

    async def lines(p, n):
        async with asyncio.timeout(5):
            while not p.exists() or p.read_text().count("\n") < n:
                await asyncio.sleep(0.02)
        return p.read_text().splitlines()
    async with aiohttp.ClientSession() as client:
        await stream(client, gw.url)
        assert len(await lines(log, 1)) == 1
        log.rename(tmp_path / "access.log.1")          # logrotate moves it ...
        gw.signal(signal.SIGUSR1)                      # ... and signals, as for nginx
        await asyncio.sleep(0.2)
        await stream(client, gw.url)
        assert len(await lines(log, 1)) == 1           # the new request, in a new file
    assert len((tmp_path / "access.log.1").read_text().splitlines()) == 1
    assert gw.proc.returncode is None
