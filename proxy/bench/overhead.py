"""How much latency and throughput does the gateway cost? Measured against nginx.

A fast stand-in upstream is reached three ways in one run, interleaved round by round:
directly, through nginx configured as operators do for SSE (proxy_buffering off, gzip off,
HTTP/1.1 upstream keep-alive), and through `prefixgate serve`. Each server runs in its own
process; this process is the client. Prints medians over rounds and ratios vs nginx.

    python -m prefixgate.proxy.bench.overhead --concurrency 1,32 --requests 2000 --rounds 3

`--observe` adds three more gateways: `gateway+log` (the JSON access log to a file),
`gateway+trace` (tracing at sample ratio 1.0 to a live OTLP/HTTP receiver in its own process,
which acknowledges each export without decoding it: a collector's parsing is its own CPU, on
another machine in production) and `gateway+both` (the two at once), reported against the
plain gateway of the same round.

`--limits` adds three gateways with an API key (every request of every target carries it):
`gateway+key` (the key, no limit), `gateway+limit` (a requests- and tokens-per-minute limit
counted in the replica) and `gateway+redis` (the same limit counted in a `redis-server` on
loopback, started here), the last two reported against `gateway+key`: the limit's own cost.

`--api messages` measures Anthropic's Messages API (`POST /v1/messages`, streamed, the
stand-in answering as vLLM does) beside chat on `direct`, `nginx` and `gateway`, as
`direct+messages`, `nginx+messages` and `gateway+messages` (each against its chat row), and
prints what the gateway adds on Messages over what it adds on chat, per concurrency:
(gateway+messages − direct+messages) − (gateway − direct), at p50.

    python -m prefixgate.proxy.bench.overhead --api messages --concurrency 1 --no-nginx

`--workers N` runs every gateway as `prefixgate serve --workers N` (N processes on one port)
and nginx with `worker_processes N` (without it: one gateway process, nginx `auto`). A
target's proxy CPU counts all its processes: nginx's master and workers, the gateway's
supervisor, workers and span exporters.

    python -m prefixgate.proxy.bench.overhead --workers 2 --concurrency 32 --rounds 3 --observe
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from prefixgate.common.percentiles import percentile
from prefixgate.common.processes import ServerProcess
from prefixgate.common.runtime import free_port, install_uvloop, wait_ready

NGINX_CONF = """
worker_processes {workers};
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream llm {{ server 127.0.0.1:{upstream_port}; keepalive 128; }}
    server {{
        listen 127.0.0.1:{port};
        gzip off;
        location / {{
            proxy_pass http://llm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_cache off;
            proxy_read_timeout 3600s;
        }}
    }}
}}
"""

BODY = {"model": "standin-model", "stream": True, "max_tokens": 1,
        "messages": [{"role": "user", "content": "ping"}]}
MESSAGES_BODY = {"model": "standin-model", "stream": True, "max_tokens": 1,
                 "messages": [{"role": "user", "content": "ping"}]}
# the API a target name's requests use: its path and body (`<target>+messages`: Messages)
APIS = {"chat": ("/v1/chat/completions", BODY), "messages": ("/v1/messages", MESSAGES_BODY)}
MESSAGES_SUFFIX = "+messages"
API_KEY = "sk-overhead-bench-key"
HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
LIMIT = "{requests_per_minute: 100000000, tokens_per_minute: 100000000000}"
BASELINE = {"gateway+limit": "gateway+key", "gateway+redis": "gateway+key"}   # else: gateway


def spawn(cmd: list[str]) -> ServerProcess:
    """A server of the run (the launcher: common/processes.py), its output discarded."""
    return ServerProcess(cmd).start()


async def one_request(session: aiohttp.ClientSession, url: str, payload: bytes) -> float:
    t0 = time.perf_counter()
    async with session.post(url, data=payload, headers=HEADERS) as r:
        first = await r.content.readany()
        ttft = time.perf_counter() - t0
        if r.status != 200 or not first:
            raise RuntimeError(f"bad response {r.status} from {url}")
        await r.read()
    return ttft


def api_of(target: str) -> str:
    return "messages" if target.endswith(MESSAGES_SUFFIX) else "chat"


def baseline_of(target: str) -> str | None:
    """The row a target is compared with (None: only with nginx): a Messages row with its
    chat row, an observed or limited gateway with the plain one (or with gateway+key)."""
    if target.endswith(MESSAGES_SUFFIX):
        return target[:-len(MESSAGES_SUFFIX)]
    if target.startswith("gateway+") and target != "gateway+key":
        return BASELINE.get(target, "gateway")
    return None


async def run_cell(url: str, concurrency: int, requests: int, warmup: int,
                   body: dict = BODY) -> dict:
    payload = json.dumps(body).encode()
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(warmup):
            await one_request(session, url, payload)
        samples: list[float] = []
        remaining = requests

        async def worker():
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                samples.append(await one_request(session, url, payload))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"p50_ms": 1000 * percentile(samples, 50), "p99_ms": 1000 * percentile(samples, 99),
            "rps": len(samples) / wall}


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and all its descendants (nginx's workers, the gateway's
    workers and their span exporters), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, cpu = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry)] = int(fields[1])        # fields[1] is the parent pid
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick

    def descends(p: int) -> bool:
        while p > 1 and p != pid:
            p = parent.get(p, 0)
        return p == pid
    return sum(seconds for p, seconds in cpu.items() if descends(p))


def start_servers(tmp: Path, tokens: int, nginx_bin: str | None,
                  observe: bool = False, limits: bool = False,
                  messages: bool = False, workers: int | None = None) -> tuple[dict, list, dict]:
    """Start the upstream, nginx and the gateway(s); return their URLs, processes and the pid
    whose CPU counts as each target's proxy cost (none for direct); with `messages`, also
    `<target>+messages` for direct, nginx and gateway (the same servers, Messages' path).
    `workers`: the gateways' processes (`listen.workers`) and nginx's `worker_processes`
    (None: one gateway process, nginx `auto`)."""
    procs, targets, pids = [], {}, {}
    up_port = free_port("127.0.0.1")
    procs.append(spawn([sys.executable, "-m", "prefixgate.proxy.testing.standin",
                        "--port", str(up_port), "--tokens", str(tokens), "--no-record"]))
    targets["direct"] = f"http://127.0.0.1:{up_port}"
    if nginx_bin:
        port = free_port("127.0.0.1")
        conf = tmp / "nginx.conf"
        conf.write_text(NGINX_CONF.format(tmp=tmp, upstream_port=up_port, port=port,
                                          workers=workers or "auto"))
        procs.append(spawn([nginx_bin, "-c", str(conf), "-p", str(tmp)]))
        targets["nginx"] = f"http://127.0.0.1:{port}"
        pids["nginx"] = procs[-1].pid
    extras = {"gateway": ""}
    if observe:
        otlp_port = free_port("127.0.0.1")
        procs.append(spawn([sys.executable, "-m", "prefixgate.proxy.testing.otlp", "--port",
                            str(otlp_port), "--no-decode"]))
        extras["gateway+log"] = f"access_log: {{path: '{tmp / 'access.log'}', format: json}}\n"
        extras["gateway+trace"] = (f"tracing: {{otlp_endpoint: 'http://127.0.0.1:{otlp_port}',"
                                   f" sample_ratio: 1.0}}\n")
        extras["gateway+both"] = extras["gateway+log"] + extras["gateway+trace"]
    if limits:
        extras.update(limit_gateways(procs))
    for name, extra in extras.items():
        port = free_port("127.0.0.1")
        cfg = tmp / f"{name}.yaml"
        cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}, workers: {workers or 1}}}\n"
                       f"upstreams:\n  - {{name: a, url: 'http://127.0.0.1:{up_port}', "
                       f"max_inflight: 4096, max_connections: 128}}\n"
                       f"plugins:\n  - least_inflight: {{}}\n  - metrics: {{}}\n{extra}")
        procs.append(spawn([sys.executable, "-m", "prefixgate.proxy.cli", "serve", "--config",
                            str(cfg), "--log-level", "warning"]))
        targets[name] = f"http://127.0.0.1:{port}"
        pids[name] = procs[-1].pid
    if messages:
        for name in [t for t in ("direct", "nginx", "gateway") if t in targets]:
            targets[name + MESSAGES_SUFFIX] = targets[name]
            if name in pids:
                pids[name + MESSAGES_SUFFIX] = pids[name]
    return targets, procs, pids


def limit_gateways(procs: list) -> dict[str, str]:
    """The `--limits` gateways' config lines (a redis-server started for the last one)."""
    key = f"auth: {{api_keys: [{{key: {API_KEY}, rate_limit: {LIMIT}}}]}}\n"
    extras = {"gateway+key": f"auth: {{api_keys: [{API_KEY}]}}\n", "gateway+limit": key}
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        print("redis-server not found (apt-get install redis-server): no gateway+redis",
              file=sys.stderr)
        return extras
    port = free_port("127.0.0.1")
    procs.append(spawn([redis_bin, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                        "--appendonly", "no"]))
    extras["gateway+redis"] = key + (f"rate_limits: {{store: 'redis://127.0.0.1:{port}/0', "
                                     f"store_timeout_ms: 1000}}\n")
    return extras


async def measure(args) -> dict:
    nginx_bin = None if args.no_nginx else shutil.which("nginx") or (
        "/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if nginx_bin is None and not args.no_nginx:
        print("nginx not found (apt-get install nginx): measuring direct and gateway only",
              file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="pg-overhead-") as tmpdir:
        targets, procs, pids = start_servers(Path(tmpdir), args.tokens, nginx_bin, args.observe,
                                             args.limits, args.api == "messages", args.workers)
        try:
            for url in targets.values():
                await wait_ready(url, "/health")    # /v1/models wants the key where one is set
            rounds: dict = {c: {t: [] for t in targets} for c in args.concurrency}
            for r in range(args.rounds):
                for c in args.concurrency:
                    for name, url in targets.items():
                        cpu0 = cpu_seconds(pids[name]) if name in pids else 0.0
                        path, body = APIS[api_of(name)]
                        cell = await run_cell(url + path, c, args.requests, args.warmup, body)
                        cpu = cpu_seconds(pids[name]) - cpu0 if name in pids else 0.0
                        cell["proxy_cpu_us"] = 1e6 * cpu / (args.requests + args.warmup)
                        rounds[c][name].append(cell)
                        print(f"round {r + 1} c={c:<3} {name:16} p50 {cell['p50_ms']:.3f} ms  "
                              f"p99 {cell['p99_ms']:.3f} ms  {cell['rps']:.0f} req/s  "
                              f"proxy CPU {cell['proxy_cpu_us']:.0f} us/req",
                              file=sys.stderr, flush=True)
        finally:
            for p in procs:
                p.stop(10)
    return {c: {t: {k: statistics.median(x[k] for x in cells) for k in cells[0]}
                for t, cells in per.items()} for c, per in rounds.items()}


def report(results: dict) -> str:
    lines = ["| concurrency | target | TTFT p50 (ms) | TTFT p99 (ms) | req/s | p50 − nginx (ms) "
             "| req/s vs nginx | p50 − baseline (ms) | req/s vs baseline | proxy CPU (µs/req) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c, per in results.items():
        base = per.get("nginx")
        for t, m in per.items():
            d = f"{m['p50_ms'] - base['p50_ms']:+.3f}" if base else "–"
            ratio = f"{m['rps'] / base['rps']:.0%}" if base else "–"
            plain = per.get(baseline_of(t))
            dg = f"{m['p50_ms'] - plain['p50_ms']:+.3f}" if plain else "–"
            rg = f"{m['rps'] / plain['rps']:.0%}" if plain else "–"
            lines.append(f"| {c} | {t} | {m['p50_ms']:.3f} | {m['p99_ms']:.3f} | "
                         f"{m['rps']:.0f} | {d} | {ratio} | {dg} | {rg} | "
                         f"{m['proxy_cpu_us']:.0f} |")
    for c, per in results.items():
        if {"direct", "gateway", "direct+messages", "gateway+messages"} <= set(per):
            chat = per["gateway"]["p50_ms"] - per["direct"]["p50_ms"]
            msgs = per["gateway+messages"]["p50_ms"] - per["direct+messages"]["p50_ms"]
            lines.append(f"\nc={c}: the gateway adds {msgs:.3f} ms p50 on Messages, "
                         f"{chat:.3f} ms on chat: Messages costs {msgs - chat:+.3f} ms more")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixgate.proxy.bench.overhead",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,32",
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--requests", type=int, default=2000, help="measured requests per cell")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians reported")
    p.add_argument("--tokens", type=int, default=1, help="SSE content events per response")
    p.add_argument("--no-nginx", action="store_true")
    p.add_argument("--observe", action="store_true",
                   help="also measure the gateway with the access log on, with tracing on, "
                        "and with both")
    p.add_argument("--limits", action="store_true",
                   help="also measure the gateway with an API key, with a rate limit, and with "
                        "the limit counted in Redis")
    p.add_argument("--api", choices=["chat", "messages"], default="chat",
                   help="messages: also measure Anthropic's Messages API (/v1/messages) on "
                        "direct, nginx and gateway, beside chat")
    p.add_argument("--workers", type=int, metavar="N",
                   help="run each gateway as `serve --workers N` and nginx with "
                        "`worker_processes N` (default: one gateway process, nginx auto)")
    p.add_argument("--out", help="save results and settings as JSON")
    args = p.parse_args(argv)
    install_uvloop()
    results = asyncio.run(measure(args))
    print(report(results))
    if args.out:
        Path(args.out).write_text(json.dumps({
            "settings": vars(args), "machine": {"cpus": os.cpu_count(),
                                                "python": platform.python_version(),
                                                "platform": platform.platform()},
            "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
