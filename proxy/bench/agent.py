"""`prefixgate bench --scenario agent`: agents' multi-turn sessions through three gateway
replicas, with next-turn warming off and on.

Each of `sessions` agents runs `turns` turns. Its request carries its agent kind's tool
definitions (about 2,000 tokens, the same for every session of a kind), its task, and every
earlier turn's answer and tool result; between turns its tool runs for a pause (exponential,
`--think-ms`, 2 s on average); agents start one after another, 0.5 s apart. Requests go to a
plain L4 balancer (proxy/testing/balancer.py) that hands each new connection to the next of
three gateway replicas, and every request opens a connection of its own, so a session's
consecutive turns reach different replicas, which share nothing: they agree on the session's
engine by its `x-session-id` (rendezvous hashing) and on what each engine holds by the
engines' KV events.

Measured per turn from the second on: the share of the turn's history (the conversation up to
and including the previous answer, as the chat template renders it) that the engine reported
cached (`usage.prompt_tokens_details.cached_tokens`, capped at the history's length), and
TTFT. Without warming the previous answer is computed again with the new turn: the tokens
the template renders back need not be the ones generated, and an answer's closing tokens were
never computed. With `prerender: {warm_next_turn: true}` the replica that streamed the answer
has the engine compute the rendered history during the tool's pause.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
from dataclasses import asdict, dataclass

from prefixgate.backend.config import served_name
from prefixgate.common.percentiles import percentile
from prefixgate.common.runtime import start_app
from prefixgate.proxy.app import Gateway
from prefixgate.proxy.bench import archive as archive_mod
from prefixgate.proxy.bench import target
from prefixgate.proxy.bench.client import Sample, stream_once
from prefixgate.proxy.bench.prompts import Lengths, words
from prefixgate.proxy.bench.seed import summed
from prefixgate.proxy.bench.stats import fmt
from prefixgate.proxy.config import gateway as config_mod
from prefixgate.proxy.testing.balancer import TCPBalancer

MODES = {"off": False, "on": True}          # next-turn warming
SESSION_HEADER = "x-session-id"


@dataclass
class AgentWorkload:
    sessions: int = 16
    turns: int = 6
    tool_tokens: int = 2000          # tool definitions of an agent kind
    kinds: int = 4                   # agent kinds (distinct tool sets); session s is kind s % kinds
    task_tokens: int = 64            # the first user message
    answer_tokens: int = 128         # every answer (ignore_eos)
    tool_result_tokens: int = 256    # appended after every answer
    think_ms: float = 2000.0         # a tool's run between an answer and the next turn (mean)
    start_gap_ms: float = 500.0      # agent s starts within [s, s + 1) gaps
    replicas: int = 3                # gateway replicas behind the balancer
    engines: int = 2
    engine_threads: int = 1          # torch threads per engine: engines x threads <= cores
    block_size: int = 16             # the engines' KV block, in tokens
    batched_tokens: int = 512        # engine step budget
    policy: str = "predicted_ttft"   # prefix_route policy
    session_mode: str = "soft"       # `session: {mode}`: soft lets the policy move a session
    rounds: int = 1                  # runs of both modes, interleaved, samples pooled
    seed: int = 0

    def final_prompt_tokens(self) -> int:
        """A session's last prompt, with room for the chat template's tokens per message."""
        return (self.tool_tokens + self.task_tokens + 64
                + (self.turns - 1) * (self.answer_tokens + self.tool_result_tokens + 16))

    def engine_args(self) -> list[str]:
        # KV for every session's whole history on either engine: what the figures measure is
        # what routing and warming keep cached, not what a small cache evicts
        blocks = self.sessions * (-(-self.final_prompt_tokens() // self.block_size) + 1)
        return ["--block-size", str(self.block_size), "--num-kv-blocks", str(blocks),
                "--max-num-seqs", str(self.sessions + 4),
                "--max-num-batched-tokens", str(self.batched_tokens), "--log-level", "warning"]


def tools_for(kind: int, tokens: int, lengths: Lengths) -> list[dict]:
    """An agent kind's tool definitions: functions with long descriptions until they count
    `tokens` (within one function's description)."""
    rng = random.Random(f"agent-tools:{kind}")
    tools: list[dict] = []
    while not tools or lengths.count(json.dumps(tools)) < tokens:
        n = len(tools)
        tools.append({"type": "function", "function": {
            "name": f"kind{kind}_tool{n}", "description": words(rng, 50),
            "parameters": {"type": "object", "properties": {
                "query": {"type": "string", "description": words(rng, 12)},
                "limit": {"type": "integer", "description": words(rng, 6)}},
                "required": ["query"]}}})
    return tools


class Conversations:
    """The sessions' requests: an agent kind's tools, a task, then the turns so far."""

    def __init__(self, w: AgentWorkload, lengths: Lengths, salt: str = ""):
        self.w, self.lengths, self.salt = w, lengths, salt
        self.tools = [tools_for(k, w.tool_tokens, lengths) for k in range(w.kinds)]

    def start(self, session: int) -> list[dict]:
        rng = random.Random(f"{self.w.seed}:{self.salt}:task:{session}")
        kind = session % self.w.kinds
        return [{"role": "system", "content": f"You are agent {kind}. Use the tools."},
                {"role": "user", "content": self.lengths.text(rng, self.w.task_tokens)}]

    def tool_result(self, session: int, turn: int) -> dict:
        """What the tool returned, sent back as a user message (the engines' answers here are
        text, not tool calls a `tool` message could answer)."""
        rng = random.Random(f"{self.w.seed}:{self.salt}:result:{session}:{turn}")
        return {"role": "user", "content": "Tool result: "
                + self.lengths.text(rng, self.w.tool_result_tokens)}

    def history_tokens(self, session: int, messages: list[dict]) -> int:
        """Tokens of the conversation up to and including its last answer, as the chat
        template renders it (what next-turn warming computes ahead)."""
        tok = self.lengths.tokenizer
        return self.lengths.count(tok.apply_chat_template(
            messages, tools=self.tools[session % self.w.kinds], add_generation_prompt=False))


@dataclass
class Turn:
    session: int
    turn: int
    history_tokens: int              # 0 on a session's first turn
    sample: Sample


def parse_workload(args) -> AgentWorkload:
    return target.given(AgentWorkload(), seed=args.seed, rounds=args.rounds,
                        think_ms=args.think_ms, answer_tokens=args.max_tokens,
                        sessions=target.first(args.concurrency), turns=args.requests or None,
                        tool_tokens=target.first(args.tiers), policy=args.policy or None)


def run_agent(args) -> int:
    w = parse_workload(args)
    model = target.scenario_model(args)
    return target.run_scenario(
        args, lambda lengths: run_modes(w, lengths, args.timeout, args.slo_ttft_ms, model),
        print_agent)


async def run_modes(w: AgentWorkload, lengths: Lengths, timeout: float, slo_ttft_ms: float,
                    model: str = "demo", modes=tuple(MODES)) -> dict:
    """Every mode, `w.rounds` times over (interleaved), each run on fresh engines."""
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(w.rounds):
        for mode in modes:
            print(f"[round {r + 1}/{w.rounds}] warming {mode}: starting {w.engines} engines "
                  f"and {w.replicas} gateway replicas", file=sys.stderr, flush=True)
            runs[mode].append(await run_mode(mode, w, lengths, timeout, model, salt=f"r{r}"))
    return {"schema": archive_mod.SCHEMA, "kind": "agent",
            "config": {"scenario": "agent", "model": model, "workload": asdict(w),
                       "engine_args": w.engine_args(), "slo_ttft_ms": slo_ttft_ms,
                       "max_tokens": w.answer_tokens,
                       "tool_tokens_built": lengths.count(json.dumps(tools_for(
                           0, w.tool_tokens, lengths)))},
            "environment": archive_mod.environment(),
            "cells": [mode_cell(m, runs[m], slo_ttft_ms / 1000.0) for m in modes]}


async def run_mode(mode: str, w: AgentWorkload, lengths: Lengths, timeout: float, model: str,
                   salt: str = "") -> dict:
    """One run: engines with KV events, the replicas behind the balancer, every session."""
    engines = await target.start_engines(["both"] * w.engines, w.engine_args(),
                                         w.engine_threads, model=model, kv_events=True)
    try:
        raw = gateway_config(engines, w, MODES[mode], model, timeout)
        async with replicas_behind_balancer(raw, w.replicas) as (url, replica_urls):
            conversations = Conversations(w, lengths, salt=f"{salt}:{mode}")
            turns: list[Turn] = []
            progress = archive_mod.Progress(w.sessions * w.turns, f"warming {mode}")
            # a connection of its own per request: the balancer sends each to the next replica
            async with target.client_session(timeout, force_close=True) as session:
                await asyncio.gather(*(
                    agent(session, url + "/v1/chat/completions", s, w, conversations,
                          served_name(model), turns, progress) for s in range(w.sessions)))
                metrics = [await archive_mod.snapshot(session, u, "/metrics", {})
                           for u in replica_urls]
    finally:
        await engines.stop()
    # (no warm API requests here: every warm request counted is a next turn's)
    return {"turns": turns, "gateway": raw,
            "warm": summed_all(metrics, "prefixgate_warm_requests_total", "outcome"),
            "sessions": summed_all(metrics, "prefixgate_route_sessions_total", "outcome")}


def gateway_config(engines, w: AgentWorkload, warm: bool, model: str, timeout: float) -> dict:
    """Every replica's config: the same, and nothing else shared."""
    ups = [{"name": f"engine{i}", "url": url,
            "kv_events": {"endpoint": pub, "replay_endpoint": replay, "topic": "kv-events"}}
           for i, (url, pub, replay) in enumerate(zip(
               engines.urls, engines.kv_events_endpoints, engines.kv_events_replay_endpoints))]
    return {"upstreams": ups, "models": {served_name(model): {"tokenizer": model}},
            "timeouts": {"first_byte": timeout, "idle": timeout},
            "plugins": [{"prerender": {"block_tokens": w.block_size, "warm_next_turn": warm}},
                        {"prefix_route": {"policy": w.policy, "index": "kv_events",
                                          "block_tokens": w.block_size,
                                          "session": {"mode": w.session_mode}}},
                        {"metrics": {}}]}


@contextlib.asynccontextmanager
async def replicas_behind_balancer(raw: dict, count: int):
    """`count` gateways with config `raw` on loopback, behind a round-robin TCP balancer:
    yields (the balancer's URL, each replica's URL)."""
    runners, urls = [], []
    balancer = None
    try:
        for _ in range(count):
            runner, url = await start_app(Gateway(config_mod.validate(raw)).make_app(),
                                          "127.0.0.1", 0)
            runners.append(runner)
            urls.append(url)
        balancer = await TCPBalancer([int(u.rsplit(":", 1)[1]) for u in urls]).start()
        yield balancer.url, urls
    finally:
        if balancer is not None:
            await balancer.stop()
        for runner in runners:
            await runner.cleanup()


async def agent(session, url: str, s: int, w: AgentWorkload, conversations: Conversations,
                model: str, turns: list[Turn], progress) -> None:
    """One agent: its turns in order, a tool's pause between them; it stops at an error."""
    rng = random.Random(f"{w.seed}:agent:{s}")
    think = w.think_ms / 1000.0
    messages = conversations.start(s)
    gap = w.start_gap_ms / 1000.0          # agent s starts within the s-th gap
    await asyncio.sleep(gap * (s + rng.random()))
    for turn in range(w.turns):
        # (a thread: the replicas share this process's event loop)
        history = await asyncio.to_thread(conversations.history_tokens, s,
                                          messages[:-1]) if turn else 0
        body = target.request_body({"messages": messages,
                                    "tools": conversations.tools[s % w.kinds]},
                                   model, w.answer_tokens, True, "chat")
        sample = await stream_once(session, url, body, {SESSION_HEADER: f"agent-{s}"},
                                   Sample(index=s * w.turns + turn, warmup=turn == 0),
                                   keep_text=True)
        turns.append(Turn(s, turn, history, sample))
        progress.step(sample.ok)
        if not sample.ok:
            return
        messages += [{"role": "assistant", "content": "".join(sample.text)},
                     conversations.tool_result(s, turn)]
        if think > 0:
            await asyncio.sleep(rng.expovariate(1.0 / think))


def summed_all(texts: list[str | None], metric: str, label: str) -> dict[str, float]:
    """`metric` summed by `label` over every replica's /metrics."""
    out: dict[str, float] = {}
    for text in texts:
        for k, v in summed(text, metric, label).items():
            out[k] = out.get(k, 0.0) + v
    return out


def mode_cell(mode: str, runs: list[dict], slo_s: float) -> dict:
    """A mode's archive cell: TTFT over turns 2 on (a session's first turn is marked warm-up),
    and the history each later turn found cached, per turn and in all."""
    turns = [t for run in runs for t in run["turns"]]
    cell = target.cell_record(f"warming {mode}", {"mode": mode, "gateway": runs[0]["gateway"]},
                              [t.sample for t in turns], slo_s)
    later = [t for t in turns if t.turn > 0 and t.sample.ok]
    by_turn: dict[int, list[Turn]] = {}
    for t in later:
        by_turn.setdefault(t.turn + 1, []).append(t)
    cell["history_cached"] = history_share(later)
    cell["history_cached_by_turn"] = {n: history_share(ts) for n, ts in sorted(by_turn.items())}
    cell["uncached_tokens_per_turn_p50"] = percentile(
        [t.sample.prompt_tokens - (t.sample.cached_tokens or 0) for t in later
         if t.sample.prompt_tokens is not None], 50)
    homes: dict[tuple, set] = {}
    for i, run in enumerate(runs):
        for t in run["turns"]:
            homes.setdefault((i, t.session), set()).add(t.sample.upstream)
    cell["sessions_on_one_engine"] = sum(1 for ups in homes.values() if len(ups) == 1)
    cell["sessions"] = len(homes)
    cell["turns"] = [{"session": t.session, "turn": t.turn + 1,
                      "history_tokens": t.history_tokens} for t in turns]
    cell["warm"], cell["route_sessions"] = {}, {}
    for run in runs:
        for total, part in ((cell["warm"], run["warm"]), (cell["route_sessions"],
                                                           run["sessions"])):
            for k, v in part.items():
                total[k] = total.get(k, 0.0) + v
    return cell


def history_share(turns: list[Turn]) -> float | None:
    """Of these turns' history tokens, the share the engines reported cached."""
    history = sum(t.history_tokens for t in turns)
    if not history:
        return None
    cached = sum(min(t.sample.cached_tokens or 0, t.history_tokens) for t in turns)
    return round(cached / history, 4)


def print_agent(archive: dict) -> None:
    w = archive["config"]["workload"]
    print(f"\nagent sessions: {w['sessions']} sessions x {w['turns']} turns through "
          f"{w['replicas']} gateway replicas (a round-robin L4 balancer, a connection per "
          f"request) in front of {w['engines']} engines on the {archive['config']['model']} "
          f"model; {archive['config']['tool_tokens_built']}-token tool definitions "
          f"({w['kinds']} agent kinds), {w['answer_tokens']}-token answers, "
          f"{w['tool_result_tokens']}-token tool results, tool pauses of "
          f"{w['think_ms'] / 1000:g} s and starts {w['start_gap_ms'] / 1000:g} s apart on "
          f"average; prefix_route {w['policy']} with {w.get('session_mode', 'soft')} sessions, "
          f"KV events. History cached: the share of each turn's history (the conversation "
          f"through the previous answer) the engine had cached; TTFT in ms over turns 2-"
          f"{w['turns']}")
    turn_heads = "".join(f"{'t' + str(n):>6}" for n in range(2, w["turns"] + 1))
    head = (f"{'warming':<9}{'history%':>9}{turn_heads}{'uncached':>9}{'p50':>7}{'p95':>7}"
            f"{'p99':>7}{'warmed':>7}{'dropped':>8}{'1-engine':>9}{'err':>5}")
    print(head + "\n" + "-" * len(head))
    for c in archive["cells"]:
        s = c["summary"]
        by_turn = c["history_cached_by_turn"]
        print(f"{c['mode']:<9}" + fmt(as_percent(c["history_cached"]), 9, 1)
              + "".join(fmt(as_percent(by_turn.get(n, by_turn.get(str(n)))), 6, 1)
                        for n in range(2, w["turns"] + 1))
              + fmt(c["uncached_tokens_per_turn_p50"], 9, 0)
              + "".join(fmt(s[f"ttft_p{q}_ms"], 7, 0) for q in (50, 95, 99))
              + fmt(int(c["warm"].get("warmed", 0)), 7) + fmt(int(c["warm"].get("dropped", 0)), 8)
              + fmt(f"{c['sessions_on_one_engine']}/{c['sessions']}", 9)
              + fmt(s["errors"], 5))


def as_percent(share: float | None) -> float | None:
    """A share (0.25) as a percentage (25.0), for the table; not a percentile."""
    return None if share is None else 100.0 * share
