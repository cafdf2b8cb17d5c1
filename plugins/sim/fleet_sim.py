"""Fleet simulator: N backends in one process, routed by the gateway's own code.

Each simulated backend keeps its prefix cache in the engine's own `BlockManager` (paged
blocks, chained hashes, LRU reuse of freed blocks) and serves with a simple cost model:

    prefill   one at a time per backend, FIFO: overhead + uncached prompt tokens / prefill rate
              (× the backend's speed: `speeds`, e.g. two of eight at 0.5, for mixed hardware)
    decode    output tokens × (TPOT + a little per running sequence), concurrent
    limits    max running sequences, and KV blocks (a request waits until its blocks fit)

Routing is a real `Gateway` built from a config with the chosen plugin (`round_robin`,
`least_inflight`, `prefix_route` chwbl / cache_aware / predicted_ttft): the same `pick()` and
scorer classes the server runs, with in-flight counts kept as the simulated requests start
and finish, and the plugins' hooks called as the gateway calls them: on_first_byte when a
prompt is computed, on_finish (with the answer's usage and its TTFT as a stream's) when the
answer ends; predicted_ttft reads the simulated clock.
Two more policies run the same cache_aware scorer with another index (`route_indexes.py`):
`exact`, fed by the engines' KV events (`engine_events.py`), which reach every gateway
replica `event_delay_s` after the engine changed its cache; and `oracle`, which asks the
engines' block managers directly.

Gateway replicas: a load balancer hands each request to one replica, in turn or at random;
each routes with its own state (its own cache_aware index; the exact indexes subscribe to
every engine, so they all learn everything).

Reported per policy: token cache hit rate and its ratio to an infinite cache shared by all
backends (`oracle_hit_rate`: a bound no finite fleet reaches, unlike the `oracle` policy),
TTFT p50/p95/p99, load imbalance (max/mean over backends of requests served and of prefill
busy time), and the routing decision's cost.

    python -m prefixgate.plugins.sim.fleet_sim --backends 8 --requests 100000
"""
from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
import time
from array import array
from collections import deque
from dataclasses import asdict, dataclass, fields

import numpy as np

from prefixgate.backend.block_manager import BlockManager
from prefixgate.common.block_hash import ROOT_HASH
from prefixgate.common.percentiles import percentile
from prefixgate.plugins.prefix_route.kv_index import decode_batch
from prefixgate.plugins.prefix_route.load_poll import LoadPoller, Sample
from prefixgate.plugins.prefix_route.plugin import PrefixRoute
from prefixgate.plugins.prefix_route.predicted_ttft import STATE_KEY as PREDICTED
from prefixgate.plugins.sim.engine_events import encode, record
from prefixgate.plugins.sim.fleet_trace import SyntheticTrace, TraceConfig
from prefixgate.plugins.sim.route_indexes import CacheOracle, EventFedIndex, install
from prefixgate.proxy.app import Gateway
from prefixgate.proxy.config.gateway import validate
from prefixgate.proxy.context import RequestContext

POLICIES = ("round_robin", "least_inflight", "chwbl", "cache_aware", "predicted_ttft", "exact",
            "oracle")
INDEXED = ("exact", "oracle")        # cache_aware's scorer with another index
# an engine publishes a step's events as the step ends, and ZMQ carries them in well under a
# millisecond: the gateway learns of a cached block about one engine step after it was stored
EVENT_DELAY_S = 0.005
WARM_REQUESTS = 50          # predicted_ttft: a backend's first answers, left out of its error
PREFILLED, FINISHED, EVENTS, POLL = range(4)    # what a heap entry is


@dataclass
class CostModel:
    """Roughly an 8B model on one H100-class GPU."""
    prefill_tokens_per_s: float = 12_000.0
    prefill_overhead_s: float = 0.005
    tpot_s: float = 0.020
    tpot_per_running_s: float = 0.0001
    kv_blocks: int = 16_384            # 262k tokens of KV at 16 tokens a block
    max_running: int = 256


def _forget(gw: Gateway, shadow: RequestContext, now: float) -> None:
    """Undo what a shadow decision (a replica asked where it would send a request it never
    gets) left in predicted_ttft: its prefill work on the chosen upstream's lane. Left there,
    it stood for work no backend has, and the replicas routed around it."""
    routed = shadow.state.get(PREDICTED)
    for plugin in gw.chain.plugins:
        scorer = getattr(plugin, "predicted", None)
        if scorer is not None and routed is not None and routed.key:
            scorer.queue.remove(routed.name, routed.key, now, answered=False)
            scorer._unsettled = None


def plugins_for(policy: str, cost: CostModel, route: dict | None = None) -> list:
    if policy in ("round_robin", "least_inflight"):
        return [policy]
    if policy in INDEXED:
        policy = "cache_aware"
    if policy not in ("chwbl", "cache_aware", "predicted_ttft"):
        raise ValueError(f"unknown policy {policy!r} (known: {', '.join(POLICIES)})")
    # the index remembers as many blocks as a backend's KV cache holds
    cfg = {"policy": policy, "dynamic_cut": "never", "index_capacity": cost.kv_blocks,
           **(route or {})}
    return [{"prefix_route": cfg}]


class SimSeq:
    """The attributes of `backend.sequence.Sequence` that the block manager uses."""
    __slots__ = ("token_ids", "block_table", "block_hashes", "num_hashed_blocks",
                 "num_computed_tokens", "num_cached_tokens", "req", "ctx", "arrived", "backend",
                 "replica")
    # simulated requests carry no cache_salt and no cache_control pins
    root_hash, cache_salt, cache_pins, num_pins_applied = ROOT_HASH, None, (), 0

    def __init__(self, req, ctx, arrived: float, backend):
        self.token_ids = array("q")             # slices to tuples at C speed, unlike numpy's
        self.token_ids.frombytes(req.tokens.tobytes())
        self.block_table: list[int] = []
        self.block_hashes = list(req.chain)       # the trace hashed them with the same formula
        self.num_hashed_blocks = 0
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.req, self.ctx, self.arrived, self.backend = req, ctx, arrived, backend
        self.replica = 0

    def __len__(self) -> int:
        return len(self.token_ids)


class Backend:
    def __init__(self, upstream, cost: CostModel, block_tokens: int, speed: float = 1.0):
        self.up = upstream
        self.prefill_tokens_per_s = cost.prefill_tokens_per_s * speed
        self.bm = BlockManager(cost.kv_blocks, block_tokens)
        self.queue: deque[SimSeq] = deque()
        self.prefilling: SimSeq | None = None
        self.running = 0
        self.served = 0
        self.answered = 0               # first bytes sent
        self.busy_s = 0.0
        self.kv_events = None           # the engine's KV event sink (exact policy only)


class FleetSim:
    def __init__(self, backends: int, policy: str, trace: TraceConfig,
                 cost: CostModel | None = None, route: dict | None = None, seed: int = 0,
                 replicas: int = 1, shared_load: bool = False, balancer: str = "turns",
                 event_delay_s: float = EVENT_DELAY_S, measure_agreement: bool = True,
                 speeds: list[float] | None = None, poll_metrics_s: float = 0.0):
        self.cost = cost or CostModel()
        speeds = speeds or [1.0] * backends
        if len(speeds) != backends:
            raise ValueError(f"{len(speeds)} speeds for {backends} backends")
        self.trace_cfg = trace
        self.policy = policy
        self.bt = trace.block_tokens
        random.seed(seed)                              # the gateway's tie-breaks
        # Gateway replicas take requests in turn (or at random: `balancer`), each with its own
        # view of the load: only its own requests (local in-flight counts) or, with
        # shared_load, every replica's (what polling the backends' /metrics converges to).
        self.gws = [Gateway(validate({
            "upstreams": [{"name": f"b{i}", "url": f"http://sim-{i}:8000", "max_inflight": 10**9}
                          for i in range(backends)],
            "plugins": plugins_for(policy, self.cost, route)})) for _ in range(replicas)]
        self.gw = self.gws[0]
        self.views = {u.name: [g.upstreams[i] for g in self.gws]
                      for i, u in enumerate(self.gw.upstreams)}
        self.shared_load = shared_load
        self.backends = {u.name: Backend(u, self.cost, self.bt, speed)
                         for u, speed in zip(self.gw.upstreams, speeds)}
        self.now = 0.0
        for gw in self.gws:
            _simulated_clock(gw, self)
        if balancer not in ("turns", "random"):
            raise ValueError(f"unknown balancer {balancer!r} (known: turns, random)")
        self.balancer, self._lb = balancer, random.Random(seed)
        self.event_delay_s = event_delay_s
        self.kv_events = 0                             # events published by the engines
        self._install_indexes()
        self.measure_agreement = measure_agreement
        self.agree = self.compared = 0
        self._turn = 0
        self.events: list = []
        self._n = 0
        self.ttft: list[float] = []
        self.pick_s: list[float] = []
        self.prompt_tokens = self.hit_tokens = self.oracle_hit_tokens = 0
        self.oracle: set[int] = set()
        self.by_kind: dict[str, list[int]] = {}        # kind -> [hit tokens, prompt tokens]
        self.prediction_errors: list[float] = []       # |predicted - TTFT| / TTFT, once warm
        self.poll_metrics_s = poll_metrics_s
        self.pollers = [self._poller(gw, i) for i, gw in enumerate(self.gws)] \
            if poll_metrics_s > 0 else []
        self._arriving = True           # polls go on while requests arrive

    def _install_indexes(self) -> None:
        """exact: every replica its own event-fed index, every engine publishing; oracle: the
        block managers themselves (one view, shared)."""
        if self.policy == "exact":
            for b in self.backends.values():
                b.kv_events = record(b.bm)
            self.event_indexes = [EventFedIndex(self.bt, self.cost.kv_blocks) for _ in self.gws]
            for gw, index in zip(self.gws, self.event_indexes):
                install(gw, index)
        elif self.policy == "oracle":
            oracle = CacheOracle({name: b.bm for name, b in self.backends.items()})
            for gw in self.gws:
                install(gw, oracle)

    def _poller(self, gw, replica: int) -> LoadPoller:
        """`poll_metrics_s`: the replica's poller of the backends' load (its first poll at its
        own moment within the interval), on the simulation's clock."""
        poller = LoadPoller(gw, self.poll_metrics_s)
        poller.clock = lambda: self.now
        self._at(replica * self.poll_metrics_s / len(self.gws), POLL, replica)
        return poller

    def _poll(self, replica: int, now: float) -> None:
        """What a replica's scrape of every backend's /metrics reads now (engine counts:
        running = prefilling or decoding, waiting = queued, KV blocks held)."""
        poller = self.pollers[replica]
        for up in self.gws[replica].upstreams:
            b = self.backends[up.name]
            poller.samples[up.name] = Sample(b.running, len(b.queue), b.bm.usage(),
                                             up.inflight, now)
            up.polled = poller
        if self._arriving:
            self._at(now + self.poll_metrics_s, POLL, replica)

    def _publish(self, b: Backend, now: float) -> None:
        """Send the engine's events of this step to every replica's index (after the delay):
        one payload on the wire, which each replica's subscriber decodes alike (so once)."""
        if b.kv_events is None or not b.kv_events.events:
            return
        events = b.kv_events.take()
        self.kv_events += len(events)
        published = (b.up.name, encode(events, now))
        if self.event_delay_s > 0:
            self._at(now + self.event_delay_s, EVENTS, published)
        else:
            self._deliver(published)

    def _deliver(self, published) -> None:
        name, payload = published
        batch = decode_batch(payload)
        for index in self.event_indexes:
            index.apply(name, batch)

    # --- the event loop -----------------------------------------------------------------------
    def _at(self, t: float, kind: int, obj) -> None:
        self._n += 1
        heapq.heappush(self.events, (t, self._n, kind, obj))

    def run(self) -> dict:
        started = time.perf_counter()
        trace = iter(SyntheticTrace(self.trace_cfg))
        nxt = next(trace, None)
        now = 0.0
        while nxt is not None or self.events:
            if nxt is not None and (not self.events or nxt.t <= self.events[0][0]):
                now = self.now = nxt.t
                self._arrive(nxt, now)
                nxt = next(trace, None)
                self._arriving = nxt is not None
                continue
            now, _, kind, obj = heapq.heappop(self.events)
            self.now = now
            if kind == PREFILLED:
                self._prefilled(obj, now)
            elif kind == FINISHED:
                self._finished(obj, now)
            elif kind == POLL:
                self._poll(obj, now)
            else:
                self._deliver(obj)
        return self._report(time.perf_counter() - started, now)

    def _arrive(self, req, now: float) -> None:
        ctx = RequestContext(request_id="", path="/v1/completions", body={}, headers={},
                             stream=True)
        ctx.tokens, ctx.block_hashes = req.tokens, req.chain
        ctx.block_tokens = self.bt
        if self.balancer == "random":
            replica = self._lb.randrange(len(self.gws))
        else:
            replica = self._turn % len(self.gws)
            self._turn += 1
        t0 = time.perf_counter()
        up = self.gws[replica].decide(ctx)
        self.pick_s.append(time.perf_counter() - t0)
        if len(self.gws) > 1 and self.measure_agreement:
            self._compare(req, replica, up.name)
        self._count(up.name, replica, +1)
        ctx.upstream, ctx.attempts = up, 1
        self._oracle_lookup(req)
        b = self.backends[up.name]
        seq = SimSeq(req, ctx, now, b)
        seq.replica = replica
        b.queue.append(seq)
        self._try_start(b, now)
        self._publish(b, now)

    def _count(self, name: str, replica: int, delta: int) -> None:
        views = self.views[name]
        if self.shared_load:
            for up in views:
                up.inflight += delta
        else:
            views[replica].inflight += delta

    def _compare(self, req, replica: int, chosen: str) -> None:
        """Would the other replicas have chosen the same upstream for this request?"""
        for i, gw in enumerate(self.gws):
            if i != replica:
                shadow = RequestContext(request_id="", path="/v1/completions", body={}, headers={})
                shadow.tokens, shadow.block_hashes = req.tokens, req.chain
                shadow.block_tokens = self.bt
                self.agree += gw.decide(shadow).name == chosen
                self.compared += 1
                _forget(gw, shadow, self.now)

    def _try_start(self, b: Backend, now: float) -> None:
        if b.prefilling is not None or not b.queue or b.running >= self.cost.max_running:
            return
        seq = b.queue[0]
        hits = b.bm.match_prefix(seq)
        if not b.bm.allocate(seq, len(seq), hits):
            return                      # KV full of running sequences: wait for one to finish
        b.queue.popleft()
        b.prefilling = seq
        b.running += 1
        uncached = len(seq) - seq.num_cached_tokens
        self.prompt_tokens += len(seq)
        self.hit_tokens += seq.num_cached_tokens
        per_kind = self.by_kind.setdefault(seq.req.kind, [0, 0])
        per_kind[0] += seq.num_cached_tokens
        per_kind[1] += len(seq)
        dur = self.cost.prefill_overhead_s + uncached / b.prefill_tokens_per_s
        b.busy_s += dur
        self._at(now + dur, PREFILLED, b)

    def _prefilled(self, b: Backend, now: float) -> None:
        seq, b.prefilling = b.prefilling, None
        seq.num_computed_tokens = len(seq)
        b.bm.cache_full_blocks(seq)
        ttft = now - seq.arrived
        self.ttft.append(ttft)
        ctx = seq.ctx
        ctx.upstream_s, ctx.status = ttft, 200
        routed = ctx.state.get(PREDICTED)
        b.answered += 1
        if routed is not None and b.answered > WARM_REQUESTS:
            self.prediction_errors.append(abs(routed.predicted_s - ttft) / ttft)
        ctx.usage = {"prompt_tokens": len(seq),
                     "prompt_tokens_details": {"cached_tokens": seq.num_cached_tokens}}
        for hook in self.gws[seq.replica].chain.on_first_byte:   # prefix_route records here
            hook(ctx)
        c = self.cost
        self._at(now + len(seq.req.output) * (c.tpot_s + c.tpot_per_running_s * b.running),
                 FINISHED, seq)
        self._try_start(b, now)
        self._publish(b, now)

    def _finished(self, seq: SimSeq, now: float) -> None:
        b = seq.backend
        history = getattr(seq.req, "history_chain", None)
        if history is not None:         # a chat turn: its answer heads the next turn's prompt
            seq.token_ids.frombytes(seq.req.output.tobytes())
            if b.bm.allocate(seq, len(seq)):
                seq.block_hashes = list(history)
                seq.num_computed_tokens = len(seq)
                b.bm.cache_full_blocks(seq)
            self.oracle.update(history)
        b.bm.free(seq)
        b.running -= 1
        b.served += 1
        self._count(b.up.name, seq.replica, -1)
        for hook in self.gws[seq.replica].chain.on_finish:     # predicted_ttft learns here
            hook(seq.ctx, None)
        self._try_start(b, now)
        self._publish(b, now)

    def _oracle_lookup(self, req) -> None:
        """An infinite cache shared by every backend: every block ever computed is a hit."""
        usable = (len(req.tokens) - 1) // self.bt
        hit = 0
        oracle = self.oracle
        for h in req.chain[:usable]:
            if h not in oracle:
                break
            hit += 1
        self.oracle_hit_tokens += hit * self.bt
        oracle.update(req.chain)

    # --- results ------------------------------------------------------------------------------
    def _report(self, wall_s: float, sim_s: float) -> dict:
        served = np.array([b.served for b in self.backends.values()], dtype=float)
        busy = np.array([b.busy_s for b in self.backends.values()])
        hit = self.hit_tokens / self.prompt_tokens
        oracle = self.oracle_hit_tokens / self.prompt_tokens
        pick_us = [s * 1e6 for s in self.pick_s]
        return {
            "policy": self.policy, "backends": len(self.backends), "requests": len(self.ttft),
            "hit_rate": hit, "oracle_hit_rate": oracle, "hit_vs_oracle": hit / oracle,
            "ttft_p50_s": percentile(self.ttft, 50),
            "ttft_p95_s": percentile(self.ttft, 95),
            "ttft_p99_s": percentile(self.ttft, 99),
            "load_max_mean_requests": float(served.max() / served.mean()),
            "load_max_mean_busy": float(busy.max() / busy.mean()),
            "utilization": float(busy.mean() / sim_s),
            "hit_rate_by_kind": {k: h / n for k, (h, n) in sorted(self.by_kind.items())},
            "pick_us_p50": percentile(pick_us, 50),
            "pick_us_p99": percentile(pick_us, 99),
            "prediction_error_p50": percentile(self.prediction_errors, 50),
            "replicas": len(self.gws), "shared_load": self.shared_load,
            "poll_metrics_s": self.poll_metrics_s,
            "balancer": self.balancer,
            "kv_events": self.kv_events, "event_delay_s": self.event_delay_s,
            "replica_agreement": self.agree / self.compared if self.compared else None,
            "sim_seconds": sim_s, "wall_seconds": wall_s,
        }


def _simulated_clock(gw, sim: FleetSim) -> None:
    """predicted_ttft's clock (its queue's progress, its fit's decay) is the simulation's."""
    for p in gw.chain.plugins:
        if isinstance(p, PrefixRoute) and p.predicted is not None:
            p.predicted.clock = lambda: sim.now


def rate_for(load: float, backends: float, cost: CostModel, trace: TraceConfig) -> float:
    """New-arrival rate at which the offered prompt tokens per second (sessions' later turns
    included) = `load` × the fleet's prefill capacity: the work if nothing were cached
    (`backends`: their number, or the sum of their speeds).

    Measured in steady state, over the second half of a sample long enough for sessions to
    have built up; the steady-state mix does not depend on the rate, so one sample serves.
    """
    n = min(trace.requests, 30_000)
    sample = TraceConfig(**{**asdict(trace), "requests": n, "rate": 50.0})
    reqs = [(r.t, len(r.tokens)) for r in SyntheticTrace(sample)][n // 2:]
    tokens_per_s = sum(k for _, k in reqs) / (reqs[-1][0] - reqs[0][0])   # at rate 50
    return load * backends * cost.prefill_tokens_per_s * 50.0 / tokens_per_s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixgate.plugins.sim.fleet_sim",
                                description="Simulate a fleet of prefix-caching backends "
                                            "under the gateway's routing policies")
    p.add_argument("--backends", type=int, default=8)
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--load", type=float, default=1.5,
                   help="offered prefill work without any cache, as a fraction of capacity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--route", default="{}", help="extra prefix_route settings, as JSON")
    p.add_argument("--replicas", type=int, default=1,
                   help="gateway replicas taking requests in turn (reports their agreement)")
    p.add_argument("--shared-load", action="store_true",
                   help="replicas see all replicas' load (as polled /metrics would show)")
    p.add_argument("--balancer", choices=("turns", "random"), default="turns",
                   help="how the load balancer in front of the replicas spreads requests")
    p.add_argument("--event-delay-s", type=float, default=EVENT_DELAY_S,
                   help="exact policy: from an engine's cache change to the replicas' indexes")
    p.add_argument("--poll-metrics-s", type=float, default=0.0,
                   help="each replica polls every backend's load (running, waiting, KV "
                   "usage) this often, as prefix_route's `poll_metrics_s` (0: never)")
    p.add_argument("--speeds", help="each backend's prefill speed, comma-separated "
                   "(default: all 1; e.g. 1,1,1,1,1,1,0.5,0.5)")
    for f in fields(CostModel):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    p.add_argument("--json", help="save results and the settings used to this file")
    args = p.parse_args(argv)
    cost = CostModel(**{f.name: getattr(args, f.name) for f in fields(CostModel)})
    speeds = [float(x) for x in args.speeds.split(",")] if args.speeds else None
    trace = TraceConfig(requests=args.requests, seed=args.seed)
    trace.rate = rate_for(args.load, sum(speeds) if speeds else args.backends, cost, trace)
    route = json.loads(args.route)
    results = []
    for policy in args.policies.split(","):
        r = FleetSim(args.backends, policy, trace, cost, route, args.seed, args.replicas,
                     args.shared_load, args.balancer, args.event_delay_s,
                     speeds=speeds, poll_metrics_s=args.poll_metrics_s).run()
        results.append(r)
        print(_row(r), flush=True)
    base = next((r for r in results if r["policy"] == "round_robin"), None)
    if base is not None:
        for r in results:
            if r is not base:
                print(f"{r['policy']:>15}: p95 TTFT {base['ttft_p95_s'] / r['ttft_p95_s']:.1f}x "
                      f"better than round_robin, hit rate {r['hit_vs_oracle']:.0%} of an "
                      f"infinite cache")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": {"backends": args.backends, "speeds": speeds,
                                    "load": args.load,
                                    "trace": asdict(trace), "cost": asdict(cost), "route": route},
                       "results": results}, f, indent=2)
    return 0


def _row(r: dict) -> str:
    return (f"{r['policy']:>15}  hit {r['hit_rate']:6.1%} "
            f"(infinite cache {r['oracle_hit_rate']:.1%}, "
            f"{r['hit_vs_oracle']:5.1%})  TTFT p50 {r['ttft_p50_s'] * 1e3:7.1f} ms  "
            f"p95 {r['ttft_p95_s'] * 1e3:8.1f} ms  p99 {r['ttft_p99_s'] * 1e3:8.1f} ms  "
            f"load max/mean {r['load_max_mean_requests']:.2f} req, {r['load_max_mean_busy']:.2f} "
            f"busy  util {r['utilization']:.0%}  pick {r['pick_us_p50']:.0f} us  "
            + (f"replicas agree {r['replica_agreement']:.1%}  "
               if r["replica_agreement"] is not None else "") +
            f"wall {r['wall_seconds']:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
