"""`prefixgate serve --workers N`: worker processes on one port under a supervisor — requests
spread over them, /metrics and the access log count each request once, SIGHUP, SIGUSR1 and
SIGTERM reach every worker, a killed worker comes back, bad start-ups fail at once."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections import Counter as Tally

import aiohttp
import yaml
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from prefixgate.proxy.observe.access_log import whole_lines
from prefixgate.proxy.observe.span_export import Encoder, worker_resource
from prefixgate.proxy.testing.otlp import decode
from prefixgate.proxy.worker_metrics import labelled
from tests.helpers import CHAT, event_json, read_events

START_S = 90          # two workers importing the gateway at once, on a busy 2-core machine


async def serve_workers(serve_process, *args, path=None):
    return await serve_process(path, *args, timeout=START_S)


def worker_pids(gw) -> list[int]:
    return [int(p) for p in re.search(r"workers \(pids ([\d, ]+)\)", gw.line).group(1).split(", ")]


async def stop(gw) -> None:
    """SIGTERM to the supervisor: it and every worker exit, with status 0."""
    pids = worker_pids(gw)
    gw.signal(signal.SIGTERM)
    assert await asyncio.wait_for(gw.proc.wait(), 60) == 0, "".join(gw.output)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"worker {pid} outlived the supervisor"


async def chats(url: str, ids: list[str]) -> list[tuple[int, str]]:
    """One chat per id, each over a connection of its own (8 at a time): (status, upstream)."""
    limit = asyncio.Semaphore(8)

    async def one(client, request_id):
        async with limit, client.post(url + "/v1/chat/completions", json=CHAT,
                                      headers={"X-Request-Id": request_id}) as r:
            await r.read()
            return r.status, r.headers.get("x-prefixgate-upstream")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as c:
        return await asyncio.gather(*(one(c, i) for i in ids))


async def scrape(url: str) -> str:
    async with aiohttp.ClientSession() as client, client.get(url + "/metrics") as r:
        assert r.status == 200
        return await r.text()


def per_worker(text: str, name: str, **labels) -> dict[str, float]:
    """The samples called `name` (with `labels`) summed per `worker` label."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and labels.items() <= s.labels.items():
                sums[s.labels["worker"]] = sums.get(s.labels["worker"], 0) + s.value
    return sums


async def log_lines(path, at_least: int, timeout: float = 30) -> list[dict]:
    """The access log's lines (each must parse whole) once there are `at_least`."""
    async with asyncio.timeout(timeout):
        while (text := path.read_text() if path.exists() else "").count("\n") < at_least:
            await asyncio.sleep(0.05)
    return [json.loads(line) for line in text.splitlines()]


def proxied(lines: list[dict]) -> list[dict]:
    return [line for line in lines if line["path"] == "/v1/chat/completions"]


async def test_requests_spread_over_workers_counted_once_in_metrics_and_log(
        tmp_path, make_standin, serve_process):
    up = await make_standin(tokens=2)
    log = tmp_path / "access.log"
    gw = await serve_workers(serve_process, "--upstream", up.url, "--port", "0",
                             "--workers", "2", "--access-log", str(log))
    ids = [f"first-{i}" for i in range(60)]
    assert [s for s, _ in await chats(gw.url, ids)] == [200] * 60
    served = per_worker(await scrape(gw.url), "prefixgate_requests_total")
    assert set(served) == {"0", "1"} and all(served.values()), served
    assert sum(served.values()) == 60 == up.completed
    lines = await log_lines(log, 61)            # and the scrape's line
    assert len(lines) == 61
    assert sorted(line["request_id"] for line in proxied(lines)) == sorted(ids)
    assert Tally(str(line["worker"]) for line in proxied(lines)) == served

    # logrotate: the file moved, SIGUSR1 to the supervisor: every worker writes a new file
    rotated = log.rename(tmp_path / "access.log.1")
    gw.signal(signal.SIGUSR1)
    sent = 0
    async with asyncio.timeout(60):
        while {line["worker"] for line in proxied(await log_lines(log, 0))} != {0, 1}:
            ids += [f"after-{sent + i}" for i in range(10)]
            assert [s for s, _ in await chats(gw.url, ids[-10:])] == [200] * 10
            sent += 10
            await asyncio.sleep(0.2)
    both = proxied(await log_lines(rotated, 61)) + proxied(await log_lines(log, 0))
    assert sorted(line["request_id"] for line in both) == sorted(ids)
    await stop(gw)


async def test_sighup_reloads_every_worker(tmp_path, make_standin, serve_process):
    a, b = await make_standin(), await make_standin()
    path = tmp_path / "gw.yaml"
    base = {"listen": {"port": 0, "workers": 2}, "admin_listen": {"port": 0},
            "health": {"interval_s": 0}, "plugins": ["metrics"]}
    path.write_text(yaml.safe_dump({**base, "upstreams": [{"name": "a", "url": a.url}]}))
    gw = await serve_workers(serve_process, path=path)
    assert {u for _, u in await chats(gw.url, [f"a{i}" for i in range(10)])} == {"a"}
    path.write_text(yaml.safe_dump({**base, "upstreams": [{"name": "b", "url": b.url}]}))
    gw.signal(signal.SIGHUP)
    for i in range(2):
        assert await gw.wait_output(f"worker {i}: config reloaded", 30), "".join(gw.output)
    assert {u for _, u in await chats(gw.url, [f"b{i}" for i in range(40)])} == {"b"}
    assert await gw.wait_output("admin (/metrics, /health) on ")      # every worker's too
    admin = re.search(r"admin \(/metrics, /health\) on (http://\S+)", "".join(gw.output))
    by_b = per_worker(await scrape(admin.group(1)), "prefixgate_ttft_seconds_count",
                      upstream="b")
    assert set(by_b) == {"0", "1"} and sum(by_b.values()) == 40, by_b
    await stop(gw)


async def test_sigterm_lets_a_stream_in_flight_finish_then_all_exit_0(make_standin,
                                                                      serve_process):
    up = await make_standin(tokens=10, gap=0.1)
    gw = await serve_workers(serve_process, "--upstream", up.url, "--port", "0",
                             "--workers", "2")
    async with aiohttp.ClientSession() as client:
        async def stream():
            async with client.post(gw.url + "/v1/chat/completions",
                                   json={**CHAT, "stream": True}) as r:
                return [event_json(e) for _, e in await read_events(r)]
        inflight = asyncio.create_task(stream())
        async with asyncio.timeout(30):
            while not up.running:
                await asyncio.sleep(0.02)
        await stop(gw)
        events = await inflight
    assert len([e for e in events if isinstance(e, dict)]) >= 10 and events[-1] == "[DONE]"


async def test_a_killed_worker_is_replaced(make_standin, serve_process):
    up = await make_standin()
    gw = await serve_workers(serve_process, "--upstream", up.url, "--port", "0",
                             "--workers", "2")
    victim = worker_pids(gw)[0]
    os.kill(victim, signal.SIGKILL)
    assert await gw.wait_output(f"worker 0 (pid {victim}) exited", 30), "".join(gw.output)
    assert await gw.wait_output("is back", START_S), "".join(gw.output)
    assert [s for s, _ in await chats(gw.url, [f"r{i}" for i in range(40)])] == [200] * 40
    served = per_worker(await scrape(gw.url), "prefixgate_requests_total")
    assert set(served) == {"0", "1"} and sum(served.values()) == 40, served
    gw.signal(signal.SIGTERM)
    assert await asyncio.wait_for(gw.proc.wait(), 60) == 0, "".join(gw.output)


async def test_the_standalone_engine_is_started_once_for_all_workers(serve_process):
    gw = await serve_workers(serve_process, "demo", "--port", "0", "--workers", "2")
    assert re.findall(r"engine\d+=", gw.line) == ["engine0="]
    assert sum("starting 1 bundled engine" in line for line in gw.output) == 1
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as c:
        for _ in range(12):
            async with c.post(gw.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200 and r.headers["x-prefixgate-upstream"] == "engine0"
    served = per_worker(await scrape(gw.url), "prefixgate_requests_total")
    assert sum(served.values()) == 12, served
    engine_port = int(re.search(r"engine0=http://127\.0\.0\.1:(\d+)", gw.line).group(1))
    await stop(gw)
    with socket.socket() as s:                    # the engine went down with the supervisor
        assert s.connect_ex(("127.0.0.1", engine_port)) != 0


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "prefixgate.proxy.cli", "serve", *args],
                          capture_output=True, text=True, timeout=START_S)


def test_bad_start_ups_fail_at_once_with_a_clear_message(tmp_path):
    proc = run_cli("--upstream", "http://127.0.0.1:9", "--workers", "0")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "prefixgate: config error: listen.workers: must be >= 1, got 0 (gateway processes)"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        proc = run_cli("--upstream", "http://127.0.0.1:9", "--workers", "2", "--port", port)
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in proc.stderr
    # a worker that cannot start (its access log is a folder) ends the start-up: no respawns
    proc = run_cli("--upstream", "http://127.0.0.1:9", "--workers", "2", "--port", "0",
                   "--access-log", str(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Is a directory" in proc.stderr and "failed to start" in proc.stdout
    assert "restarting" not in proc.stdout + proc.stderr


def test_metrics_of_every_worker_once_each_with_its_worker_label():
    expositions = []
    for worker, n in enumerate((2, 3)):
        registry = CollectorRegistry()
        Counter("x_requests", "Requests", ["status"], registry=registry).labels("200").inc(n)
        Histogram("x_seconds", "Latency", buckets=(0.1, 1.0), registry=registry).observe(0.5)

        class Collected:          # the gateway's scrape-time collectors yield families
            def collect(self, n=n):
                gauge = GaugeMetricFamily("x_inflight", "In flight", labels=["upstream"])
                gauge.add_metric(["a"], n)
                counter = CounterMetricFamily("x_events", "Events", labels=["kind"])
                counter.add_metric(["stored"], 10 * n)
                yield from (gauge, counter)
        registry.register(Collected())
        expositions.append((worker, generate_latest(registry).decode()))
    text = labelled(expositions).decode()
    for line in ("# TYPE x_requests_total counter", "# TYPE x_seconds histogram",
                 "# TYPE x_inflight gauge", "# TYPE x_events_total counter"):
        assert text.count(line) == 1, text
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(text) for s in f.samples}
    for worker, n in (("0", 2), ("1", 3)):
        assert values["x_requests_total", (("status", "200"), ("worker", worker))] == n
        assert values["x_seconds_bucket", (("le", "1.0"), ("worker", worker))] == 1
        assert values["x_seconds_count", (("worker", worker),)] == 1
        assert values["x_inflight", (("upstream", "a"), ("worker", worker))] == n
        assert values["x_events_total", (("kind", "stored"), ("worker", worker))] == 10 * n


def test_each_workers_spans_carry_its_index_and_instance():
    span = ("chat m", 2, 1, 2, None, 10, 20, {"a": 1}, None)
    for worker in (0, 1):
        [decoded] = decode(Encoder("prefixgate", worker_resource(worker)).encode([span]))
        assert decoded["resource"]["prefixgate.worker"] == worker
        assert decoded["resource"]["service.instance.id"].endswith(f"-{worker}")
    [alone] = decode(Encoder("prefixgate").encode([span]))
    assert alone["resource"] == {"service.name": "prefixgate"}


def test_a_pipe_gets_whole_lines_in_writes_it_keeps_whole():
    lines = [f'{{"n":{i},"pad":"{"x" * (i % 300)}"}}' for i in range(200)]
    writes = whole_lines(lines, 4096)
    assert all(len(w) <= 4096 and w.endswith(b"\n") for w in writes) and len(writes) > 1
    assert b"".join(writes).decode().splitlines() == lines
    assert whole_lines(["y" * 5000, "z"], 4096) == [b"y" * 5000 + b"\n", b"z\n"]
