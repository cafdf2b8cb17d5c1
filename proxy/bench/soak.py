"""Soak: stream through `prefixgate serve` for minutes and prove nothing is lost or leaked.

    python -m prefixgate.proxy.bench.soak --minutes 10 --concurrency 64

The gateway and the stand-in upstreams each run in their own process (so the gateway's RSS
and open file descriptors are its own). Every request asks for a random number of tokens
under a per-request nonce (the stand-in echoes it as the model name), and the response
bytes must equal exactly what the stand-in produces for that request — so a lost,
truncated, duplicated or cross-wired response shows up. The stand-ins' own counters must
match the client's (no request sent upstream twice). Checks, printed and saved as JSON:
  zero failed responses; upstream-completed == client-sent; gateway RSS growth < 10% from
  the end of warm-up to the end; open fds after the load back to the post-warm-up baseline.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import yaml
from aiohttp import web

from prefixgate.common.runtime import install_uvloop
from prefixgate.proxy.testing.standin import Behaviour, StandIn, streamed_bytes


# --- child processes -------------------------------------------------------------------------
class CountingStandIn(StandIn):
    """A stand-in that also reports its counters over HTTP, for a soak run from outside."""

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_get("/soak/stats", self.stats)
        return app

    async def stats(self, request):
        return web.json_response({"completed": self.completed, "aborted": self.aborted,
                                  "connections": self.connections})


def standin_main(port: int) -> None:
    install_uvloop()

    async def run():
        s = await CountingStandIn(Behaviour(record=False)).start(port=port)
        print(f"standin on {s.url}", flush=True)
        await asyncio.Event().wait()
    asyncio.run(run())


async def spawn(args: list[str], pattern: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    while True:
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        if not line:
            raise RuntimeError(f"{args} exited before it listened")
        m = re.search(pattern, line)
        if m:
            asyncio.get_running_loop().create_task(_discard(proc.stdout))
            return proc, m.group(1)


async def _discard(stream) -> None:
    async for _ in stream:
        pass


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# --- the load --------------------------------------------------------------------------------
def expected_stream(body: dict, tokens: int, model: str) -> bytes:
    """The exact bytes the stand-in streams for this request."""
    return streamed_bytes(body, tokens, model)


class Tally:
    def __init__(self):
        self.sent = self.ok = 0
        self.failed: dict[str, int] = {}
        self.examples: list[str] = []

    def fail(self, kind: str, detail: str) -> None:
        self.failed[kind] = self.failed.get(kind, 0) + 1
        if len(self.examples) < 10:
            self.examples.append(f"{kind}: {detail}")


async def one_request(client, url, rng: random.Random, tally: Tally, args) -> None:
    tokens = rng.randint(4, args.max_tokens)
    nonce = uuid.uuid4().hex
    body = {"model": "standin-model", "stream": True,
            "messages": [{"role": "user", "content": "soak " * rng.randint(1, 200)}],
            "x_standin": {"tokens": tokens, "model": nonce,
                          "gap": rng.random() * args.gap_ms / 1000}}
    want = expected_stream(body, tokens, nonce)
    tally.sent += 1
    try:
        async with client.post(url + "/v1/chat/completions", json=body) as r:
            got = await r.read()
            status = r.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        tally.fail("lost", f"{type(e).__name__}: {e}")
        return
    if status != 200:
        tally.fail("status", f"{status} {got[:200]!r}")
    elif got == want:
        tally.ok += 1
    elif want.startswith(got):
        tally.fail("truncated", f"{len(got)} of {len(want)} bytes")
    elif got.count(b"[DONE]") > 1 or len(got) > len(want):
        tally.fail("duplicated", f"{len(got)} bytes for {len(want)}")
    else:
        tally.fail("mismatch", f"{got[:120]!r} vs {want[:120]!r}")


async def load(url: str, seconds: float, args, tally: Tally, seed: int) -> None:
    deadline = time.monotonic() + seconds
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.concurrency),
                                     timeout=timeout) as client:
        async def worker():
            while time.monotonic() < deadline:
                await one_request(client, url, rng, tally, args)
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))


async def upstream_completed(client, urls) -> int:
    total = 0
    for u in urls:
        async with client.get(u + "/soak/stats") as r:
            total += (await r.json())["completed"]
    return total


async def settle_fds(pid: int, seconds: float = 3.0) -> int:
    """Open fds once the count stops falling (closed client connections finish closing)."""
    await asyncio.sleep(0.5)
    best = fds(pid)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        best = min(best, fds(pid))
    return best


async def soak(args) -> dict:
    children = []
    try:
        standins = []
        for _ in range(args.upstreams):
            proc, url = await spawn(["-m", "prefixgate.proxy.bench.soak", "--standin-worker"],
                                    r"standin on (http://\S+)")
            children.append(proc)
            standins.append(url)
        cfg = {"listen": {"host": "127.0.0.1", "port": 0},
               "upstreams": [{"name": f"s{i}", "url": u} for i, u in enumerate(standins)],
               "plugins": ["least_inflight", {"admission": {}}, "metrics"]}
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "soak.yaml"
            path.write_text(yaml.safe_dump(cfg))
            gw_proc, gw_url = await spawn(["-m", "prefixgate.proxy.cli", "serve", "--config",
                                           str(path), "--log-level", "warning"],
                                          r"listening on (http://\S+)")
        children.append(gw_proc)
        pid = gw_proc.pid
        fds_start = fds(pid)

        warm, main = Tally(), Tally()
        print(f"soak: gateway pid {pid} at {gw_url}; {args.upstreams} stand-ins; warm-up "
              f"{args.warmup_s:.0f}s then {args.seconds:.0f}s at concurrency {args.concurrency}",
              flush=True)
        await load(gw_url, args.warmup_s, args, warm, seed=1)
        fds_base = await settle_fds(pid)
        rss_base = rss(pid)
        samples = []

        async def sample():
            while True:
                await asyncio.sleep(args.sample_s)
                samples.append({"t": round(time.monotonic() - t0, 1), "rss": rss(pid),
                                "fds": fds(pid), "ok": main.ok})
                print(f"  t={samples[-1]['t']:>6.0f}s  rss={samples[-1]['rss'] / 2**20:6.1f} MiB"
                      f"  fds={samples[-1]['fds']:4d}  ok={main.ok}  failed="
                      f"{sum(main.failed.values())}", flush=True)
        t0 = time.monotonic()
        sampler = asyncio.get_running_loop().create_task(sample())
        await load(gw_url, args.seconds, args, main, seed=2)
        sampler.cancel()
        elapsed = time.monotonic() - t0
        rss_end = rss(pid)
        fds_end = await settle_fds(pid)
        async with aiohttp.ClientSession() as client:
            completed = await upstream_completed(client, standins)
            async with client.get(gw_url + "/health") as r:
                healthy = r.status == 200
        sent = warm.sent + main.sent
        growth = (rss_end - rss_base) / rss_base
        result = {
            "config": {"seconds": args.seconds, "warmup_s": args.warmup_s,
                       "concurrency": args.concurrency, "upstreams": args.upstreams,
                       "max_tokens": args.max_tokens, "gap_ms": args.gap_ms},
            "requests": main.sent, "ok": main.ok, "failed": main.failed,
            "examples": main.examples + warm.examples,
            "warmup": {"requests": warm.sent, "ok": warm.ok, "failed": warm.failed},
            "requests_per_s": round(main.sent / elapsed, 1),
            "upstream_completed": completed, "client_sent": sent,
            "rss_base_mib": round(rss_base / 2**20, 2), "rss_end_mib": round(rss_end / 2**20, 2),
            "rss_growth_pct": round(100 * growth, 2),
            "fds_start": fds_start, "fds_base": fds_base, "fds_end": fds_end,
            "gateway_healthy": healthy, "samples": samples,
        }
        result["pass"] = {
            "no_failed_responses": not main.failed and not warm.failed,
            "upstream_count_matches": completed == sent,
            "rss_growth_below_10pct": growth < 0.10,
            "fds_back_to_baseline": fds_end <= fds_base,
            "gateway_healthy": healthy,
        }
        return result
    finally:
        for proc in children:
            if proc.returncode is None:
                proc.terminate()
        for proc in children:
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixgate.proxy.bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seconds", type=float, help="run time in seconds (overrides --minutes)")
    p.add_argument("--warmup-s", type=float, default=None,
                   help="load before the baseline is taken (default: 5%% of the run, 5-30 s)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--upstreams", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per response: 4..N")
    p.add_argument("--gap-ms", type=float, default=4.0, help="max gap between tokens")
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--json", help="save the result here")
    p.add_argument("--standin-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.standin_worker:
        standin_main(0)
        return 0
    args.seconds = args.seconds if args.seconds is not None else args.minutes * 60
    if args.warmup_s is None:
        args.warmup_s = min(30.0, max(5.0, args.seconds * 0.05))
    install_uvloop()
    result = asyncio.run(soak(args))
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    ok = all(result["pass"].values())
    print("soak: PASS" if ok else "soak: FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
