"""`prefixgate bench --scenario agent`: agents' multi-turn sessions through three gateway
replicas, with next-turn warming off and on, and (`--api messages`) coding agents shaped like
Claude Code over Anthropic's Messages API against a round-robin baseline.

Each of `sessions` agents runs `turns` turns. Its request carries its agent kind's tool
definitions (the same for every session of a kind), its task, and every earlier turn's answer
and tool result; between turns its tool runs for a pause (exponential, `--think-ms`, 2 s on
average); agents start one after another, 0.5 s apart. Requests go to a plain L4 balancer
(proxy/testing/balancer.py) that hands each new connection to the next of three gateway
replicas, and every request opens a connection of its own, so a session's consecutive turns
reach different replicas, which share nothing: they agree on the session's engine by its
session key (rendezvous hashing) and on what each engine holds by the engines' KV events.

`--api chat` (the default): OpenAI chat requests (about 2,000 tokens of tools, the session in
`x-session-id`), next-turn warming off and on. `--api messages`: `/v1/messages` requests as
Claude Code sends them: a system prompt in blocks (Claude Code's per-request billing header
first, `cache_control` on the last block), Anthropic tool definitions, the history as
`tool_use` / `tool_result` blocks (`cache_control` on the last message's last block), the
session in `x-claude-code-session-id` and `metadata.user_id`; 8 sessions of 10 turns, each
tool result 1/16 of the model's context (file reads and command output: the history outgrows
the shared prefix, as Claude Code's does), the system prompt and tools as large as the context
leaves beside 10 turns (SmolLM2's 8,192 tokens; the demo model's 16,384; the tools three
quarters of that, the system prompt the rest as the chat template renders it: templates that
leave tools out, as SmolLM2's does, get a longer system prompt), each engine's KV cache room
for half of the sessions' histories (`kv_share`: a fleet's caches hold some sessions, not all).
Its modes: prefixgate as meant to run (`on`: prefix_route, next-turn warming) and
`round-robin` (the same chain with prefix_route replaced by round robin, no warming: a plain
balancer's placement). `--engine vllm` puts two real vLLM servers (vLLM's CPU
build, proxy/testing/real_vllm.py; SmolLM2 unless `--model` says otherwise) in place of the
bundled engines.

Measured per turn from the second on: the share of the turn's history (the conversation up to
and including the previous answer, as the chat template renders it; for Messages, the chat
request vLLM makes of it) that the engine reported cached (`cached_tokens`, or Messages'
`cache_read_input_tokens`, capped at the history's length), and TTFT. Without warming the
previous answer is computed again with the new turn: the tokens the template renders back
need not be the ones generated, and an answer's closing tokens were never computed. With
`prerender: {warm_next_turn: true}` the replica that streamed the answer has the engine
compute the rendered history during the tool's pause. The report gives prefixgate's p95 TTFT
of turns >= 2 over round robin's, beside the issue's targets (>= 95% of each turn's history
from cache, p95 <= 0.5x round robin's).
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import random
import sys
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prefixgate.backend.config import resolve_model, served_name
from prefixgate.common.anthropic_messages import to_chat
from prefixgate.common.gguf_file import field as gguf_field
from prefixgate.common.gguf_file import open_gguf
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
from prefixgate.proxy.testing import real_vllm, vllm_install
from prefixgate.proxy.testing.balancer import TCPBalancer


@dataclass(frozen=True)
class Mode:
    warm: bool                       # prerender's next-turn warming
    routing: str                     # the routing plugin: prefix_route | round_robin


MODES = {"off": Mode(False, "prefix_route"), "on": Mode(True, "prefix_route"),
         "round-robin": Mode(False, "round_robin")}
API_MODES = {"chat": ("off", "on"), "messages": ("on", "round-robin")}
PREFIXGATE, BASELINE = "on", "round-robin"       # the ratio's two modes
TARGET_HISTORY, TARGET_RATIO = 0.95, 0.5         # the targets (#40)
SESSION_HEADER = "x-session-id"
CLAUDE_SESSION_HEADER = "x-claude-code-session-id"
EPHEMERAL = {"type": "ephemeral"}
# a Messages turn's tokens beyond its answer and tool result: the template's, the tool call's,
# and an answer's text that renders back longer than it was generated
TURN_OVERHEAD = 128
RESULT_SHARE = 16                # messages: a tool result is 1/16 of the context (demo: 1,024)
VLLM_DTYPE = "float32"           # as the seed scenario runs vLLM
VLLM_BLOCK = real_vllm.BLOCK_SIZE


@dataclass
class AgentWorkload:
    sessions: int = 16
    turns: int = 6
    tool_tokens: int | None = 2000   # tool definitions of an agent kind (None: messages' fit)
    kinds: int = 4                   # agent kinds (distinct tool sets); session s is kind s % kinds
    task_tokens: int = 64            # the first user message
    answer_tokens: int = 128         # every answer (chat: ignore_eos; messages: at most)
    tool_result_tokens: int | None = 256   # appended after every answer (None: messages' fit)
    think_ms: float = 2000.0         # a tool's run between an answer and the next turn (mean)
    start_gap_ms: float = 500.0      # agent s starts within [s, s + 1) gaps
    replicas: int = 3                # gateway replicas behind the balancer
    engines: int = 2
    engine_threads: int = 1          # torch threads per engine: engines x threads <= cores
    block_size: int = 16             # the bundled engines' KV block, in tokens
    batched_tokens: int = 512        # engine step budget
    policy: str = "predicted_ttft"   # prefix_route policy
    session_mode: str = "soft"       # `session: {mode}`: soft lets the policy move a session
    rounds: int = 1                  # runs of every mode, interleaved, samples pooled
    seed: int = 0
    api: str = "chat"                # chat | messages (Anthropic's, shaped like Claude Code's)
    engine: str = "bundled"          # bundled | vllm
    prefix_tokens: int | None = None  # messages: system prompt + tools as rendered (None: fit)
    context: int | None = None       # the model's context (messages; set when a run starts)
    # the share of the sessions whose whole history one engine's KV cache holds (None: all of
    # them). Below 1, caches are scarce, as an agent fleet's are: a backend holds the prefixes
    # of some sessions, not of all, and round robin makes every backend hold every session's
    kv_share: float | None = None

    def fit_to(self, context: int) -> None:
        """Messages: the model's context, and the tool results' share of it where unset."""
        self.context = context
        if self.tool_result_tokens is None:
            self.tool_result_tokens = context // RESULT_SHARE

    def final_prompt_tokens(self) -> int:
        """A session's last prompt, with room for the chat template's tokens per message (for
        Messages: all the context leaves beside the last answer)."""
        if self.api == "messages":
            return self.context - self.answer_tokens - 64
        return (self.tool_tokens + self.task_tokens + 64
                + (self.turns - 1) * (self.answer_tokens + self.tool_result_tokens + 16))

    def prefix_budget(self) -> int:
        """Messages: the system prompt's and tools' tokens, as rendered, that leave room for
        every turn within the context (or `prefix_tokens`)."""
        if self.prefix_tokens is not None:
            return self.prefix_tokens
        room = self.final_prompt_tokens() - self.task_tokens - 32 - (self.turns - 1) * (
            self.answer_tokens + self.tool_result_tokens + TURN_OVERHEAD)
        if room < 256:
            raise RuntimeError(f"{self.turns} turns of {self.answer_tokens}-token answers and "
                               f"{self.tool_result_tokens}-token tool results leave no room "
                               f"for a system prompt in a {self.context}-token context")
        return room

    def kv_sessions(self) -> int:
        """Sessions whose whole history one engine's KV cache holds (`kv_share`)."""
        return self.sessions if self.kv_share is None else max(
            1, math.ceil(self.sessions * self.kv_share))

    def kv_blocks(self, block_size: int) -> int:
        return self.kv_sessions() * (-(-self.final_prompt_tokens() // block_size) + 1)

    def engine_args(self) -> list[str]:
        # KV for `kv_share` of the sessions' whole histories on either engine (default: all:
        # then the figures measure what routing and warming keep cached, not what evicts)
        blocks = self.kv_blocks(self.block_size)
        return ["--block-size", str(self.block_size), "--num-kv-blocks", str(blocks),
                "--max-num-seqs", str(self.sessions + 4),
                "--max-num-batched-tokens", str(self.batched_tokens), "--log-level", "warning"]

    def vllm_args(self) -> list[str]:
        # requests carry tools, which vLLM refuses without a tool parser; SmolLM2 names none,
        # and pythonic's needs no special tokens (as the seed scenario runs vLLM)
        scarce = ([] if self.kv_share is None else
                  ["--num-gpu-blocks-override", str(self.kv_blocks(VLLM_BLOCK))])
        return ["--max-model-len", str(self.context or self.final_prompt_tokens() + 256),
                "--max-num-seqs", str(self.sessions + 4),
                "--enable-auto-tool-choice", "--tool-call-parser", "pythonic", *scarce]


def workload_for(api: str = "chat", **flags) -> AgentWorkload:
    """The workload of an API's scenario: chat's defaults, or Claude Code's shape for messages
    (8 sessions of 10 turns, the prefix fitted to the context, each engine's KV cache holding
    half of the sessions' histories, tool results 1/16 of the context); `flags` given win."""
    base = AgentWorkload(api=api)
    if api == "messages":
        base = AgentWorkload(api=api, sessions=8, turns=10, tool_tokens=None,
                             tool_result_tokens=None, kv_share=0.5)
    return target.given(base, **flags)


def model_context(model: str) -> int:
    """The model's context in tokens: a GGUF's `<arch>.context_length`, a directory's
    config.json `max_position_embeddings`."""
    path = Path(resolve_model(model))
    if path.suffix.lower() == ".gguf":
        reader = open_gguf(path)
        return int(gguf_field(reader, f"{gguf_field(reader, 'general.architecture')}"
                                      f".context_length"))
    config = json.loads((path / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 4096)


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


def anthropic_tools(kind: int, tokens: int, lengths: Lengths) -> list[dict]:
    """An agent kind's tools in Anthropic's shape (`input_schema`), long descriptions as Claude
    Code's, until they count `tokens` (within one tool's)."""
    rng = random.Random(f"agent-anthropic-tools:{kind}")
    tools: list[dict] = []
    while not tools or lengths.count(json.dumps(tools)) < tokens:
        n = len(tools)
        tools.append({"name": f"Kind{kind}Tool{n}", "description": words(rng, 160),
                      "input_schema": {
                          "type": "object", "$schema": "http://json-schema.org/draft-07/schema#",
                          "additionalProperties": False, "required": ["query"],
                          "properties": {
                              "query": {"type": "string", "description": words(rng, 16)},
                              "limit": {"type": "number", "description": words(rng, 8)}}}})
    return tools


class Conversations:
    """The sessions' chat requests: an agent kind's tools, a task, then the turns so far."""
    path = "/v1/chat/completions"

    def __init__(self, w: AgentWorkload, lengths: Lengths, salt: str = ""):
        self.w, self.lengths, self.salt = w, lengths, salt
        self.tools = [tools_for(k, w.tool_tokens, lengths) for k in range(w.kinds)]

    def start(self, session: int) -> list[dict]:
        rng = random.Random(f"{self.w.seed}:{self.salt}:task:{session}")
        kind = session % self.w.kinds
        return [{"role": "system", "content": f"You are agent {kind}. Use the tools."},
                {"role": "user", "content": self.lengths.text(rng, self.w.task_tokens)}]

    def body(self, session: int, turn: int, messages: list[dict], model: str) -> dict:
        return target.request_body({"messages": messages,
                                    "tools": self.tools[session % self.w.kinds]},
                                   model, self.w.answer_tokens, True, "chat")

    def headers(self, session: int, turn: int) -> dict:
        return {SESSION_HEADER: f"agent-{session}"}

    def answered(self, session: int, turn: int, messages: list[dict], text: str) -> None:
        messages += [{"role": "assistant", "content": text}, self.tool_result(session, turn)]

    def tool_result(self, session: int, turn: int) -> dict:
        """What the tool returned, sent back as a user message (the engines' answers here are
        text, not tool calls a `tool` message could answer)."""
        rng = random.Random(f"{self.w.seed}:{self.salt}:result:{session}:{turn}")
        return {"role": "user", "content": "Tool result: "
                + self.lengths.text(rng, self.w.tool_result_tokens)}

    def history(self, session: int, messages: list[dict]) -> int:
        """Tokens of a turn's history: the conversation before its last message."""
        return self.history_tokens(session, messages[:-1])

    def history_tokens(self, session: int, messages: list[dict]) -> int:
        """Tokens of the conversation up to and including its last answer, as the chat
        template renders it (what next-turn warming computes ahead)."""
        tok = self.lengths.tokenizer
        return self.lengths.count(tok.apply_chat_template(
            messages, tools=self.tools[session % self.w.kinds], add_generation_prompt=False))

    def built(self) -> dict:
        return {"tool_tokens_built": self.lengths.count(json.dumps(self.tools[0]))}


class MessagesConversations(Conversations):
    """The sessions' /v1/messages requests, shaped as Claude Code sends them (module doc)."""
    path = "/v1/messages"

    def __init__(self, w: AgentWorkload, lengths: Lengths, salt: str = ""):
        self.w, self.lengths, self.salt = w, lengths, salt
        budget = w.prefix_budget()
        tools = w.tool_tokens if w.tool_tokens is not None else budget * 3 // 4
        self.tools = [anthropic_tools(k, tools, lengths) for k in range(w.kinds)]
        self.system = [self._system_text(k, budget) for k in range(w.kinds)]

    def _system_text(self, kind: int, budget: int) -> str:
        """The kind's system prompt: as long as the budget leaves beside its tools, as the
        chat template renders the two."""
        head = (f"You are agent {kind}, an interactive coding agent. Use the tools available "
                f"to you to help the user with software engineering tasks.\n\n")
        rest = budget - self._prefix_tokens(kind, head)
        return head + self.lengths.text(random.Random(f"agent-system:{kind}"), max(0, rest))

    def _prefix_tokens(self, kind: int, system: str) -> int:
        return self._rendered({"system": system, "tools": self.tools[kind], "messages": []})

    def _rendered(self, body: dict) -> int:
        chat = to_chat(body)
        return self.lengths.count(self.lengths.tokenizer.apply_chat_template(
            chat["messages"], tools=chat.get("tools"), add_generation_prompt=False))

    def start(self, session: int) -> list[dict]:
        rng = random.Random(f"{self.w.seed}:{self.salt}:task:{session}")
        return [{"role": "user", "content": [
            {"type": "text", "text": self.lengths.text(rng, self.w.task_tokens)}]}]

    def _ids(self, session: int) -> tuple[str, str]:
        """(session UUID, account UUID) of a session, fixed by the run's seed and salt."""
        rng = random.Random(f"{self.w.seed}:{self.salt}:ids:{session}")
        return str(uuid.UUID(int=rng.getrandbits(128))), str(uuid.UUID(int=rng.getrandbits(128)))

    def body(self, session: int, turn: int, messages: list[dict], model: str) -> dict:
        kind = session % self.w.kinds
        session_id, account = self._ids(session)
        cch = hashlib.sha256(f"{self.salt}:{session}:{turn}".encode()).hexdigest()
        last = messages[-1]
        marked = [*messages[:-1], {**last, "content": [
            *last["content"][:-1], {**last["content"][-1], "cache_control": EPHEMERAL}]}]
        return {"model": model, "max_tokens": self.w.answer_tokens, "stream": True,
                "temperature": 0.0,
                "system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version="
                            f"2.1.0.{cch[:3]}; cc_entrypoint=cli; cch={cch[3:8]};"},
                           {"type": "text", "text": self.system[kind],
                            "cache_control": EPHEMERAL}],
                "tools": self.tools[kind], "messages": marked,
                "metadata": {"user_id": f"user_{cch[8:40]}_account_{account}"
                                        f"_session_{session_id}"}}

    def headers(self, session: int, turn: int) -> dict:
        return {CLAUDE_SESSION_HEADER: self._ids(session)[0], "anthropic-version": "2023-06-01"}

    def answered(self, session: int, turn: int, messages: list[dict], text: str) -> None:
        """The answer with the tool call Claude Code's model would have made, and its result."""
        rng = random.Random(f"{self.w.seed}:{self.salt}:result:{session}:{turn}")
        tools = self.tools[session % self.w.kinds]
        call = f"toolu_{hashlib.sha256(f'{self.salt}:{session}:{turn}'.encode()).hexdigest()[:24]}"
        messages += [
            {"role": "assistant", "content": [
                {"type": "text", "text": text or "."},
                {"type": "tool_use", "id": call, "name": tools[turn % len(tools)]["name"],
                 "input": {"query": words(rng, 6), "limit": 20}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call,
                 "content": self.lengths.text(rng, self.w.tool_result_tokens)}]}]

    def history(self, session: int, messages: list[dict]) -> int:
        kind = session % self.w.kinds
        return self._rendered({"system": self.system[kind], "tools": self.tools[kind],
                               "messages": messages[:-1]})

    def built(self) -> dict:
        return {"tool_tokens_built": self.lengths.count(json.dumps(self.tools[0])),
                "prefix_tokens_built": self._prefix_tokens(0, self.system[0])}


def conversations_for(w: AgentWorkload, lengths: Lengths, salt: str = "") -> Conversations:
    return (MessagesConversations if w.api == "messages" else Conversations)(w, lengths, salt)


@dataclass
class Turn:
    session: int
    turn: int
    history_tokens: int              # 0 on a session's first turn
    sample: Sample


def parse_workload(args) -> AgentWorkload:
    return workload_for(getattr(args, "api", None) or "chat", seed=args.seed,
                        rounds=args.rounds, think_ms=args.think_ms,
                        answer_tokens=args.max_tokens,
                        sessions=target.first(args.concurrency), turns=args.requests or None,
                        tool_tokens=target.first(args.tiers), policy=args.policy or None,
                        engine=getattr(args, "engine", None))


def run_agent(args) -> int:
    w = parse_workload(args)
    if w.engine == "vllm":
        args.model = args.model or "smollm2"
    model = target.scenario_model(args)
    return target.run_scenario(
        args, lambda lengths: run_modes(w, lengths, args.timeout, args.slo_ttft_ms, model),
        print_agent)


async def run_modes(w: AgentWorkload, lengths: Lengths, timeout: float, slo_ttft_ms: float,
                    model: str = "demo", modes=None) -> dict:
    """Every mode (the API's, unless named), `w.rounds` times over (interleaved), each run on
    fresh engines."""
    modes = tuple(modes or API_MODES[w.api])
    if w.api == "messages":
        w.fit_to(w.context or model_context(model))
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(w.rounds):
        for mode in modes:
            print(f"[round {r + 1}/{w.rounds}] {mode}: starting {w.engines} {w.engine} engines "
                  f"and {w.replicas} gateway replicas", file=sys.stderr, flush=True)
            runs[mode].append(await run_mode(mode, w, lengths, timeout, model, salt=f"r{r}"))
    cells = [mode_cell(m, runs[m], slo_ttft_ms / 1000.0) for m in modes]
    return {"schema": archive_mod.SCHEMA, "kind": "agent",
            "config": {"scenario": "agent", "model": model, "workload": asdict(w),
                       "engine_args": w.vllm_args() if w.engine == "vllm" else w.engine_args(),
                       "slo_ttft_ms": slo_ttft_ms, "max_tokens": w.answer_tokens,
                       **conversations_for(w, lengths).built()},
            "environment": archive_mod.environment(),
            "cells": cells, "comparison": comparison(cells)}


@dataclass
class Fleet:
    """The engines of a run as the gateway sees them."""
    upstreams: list[dict]            # the gateway's `upstreams:` (with `kv_events:`)
    tokenizer: str                   # what the gateway's prerender tokenizes with
    block_tokens: int                # their KV block
    stop: Callable[[], Awaitable[None]] = field(repr=False)


async def start_fleet(w: AgentWorkload, model: str) -> Fleet:
    return await (start_vllm(w, model) if w.engine == "vllm" else start_bundled(w, model))


async def start_bundled(w: AgentWorkload, model: str) -> Fleet:
    engines = await target.start_engines(["both"] * w.engines, w.engine_args(),
                                         w.engine_threads, model=model, kv_events=True)
    ups = [{"name": f"engine{i}", "url": url,
            "kv_events": {"endpoint": pub, "replay_endpoint": replay, "topic": "kv-events"}}
           for i, (url, pub, replay) in enumerate(zip(
               engines.urls, engines.kv_events_endpoints, engines.kv_events_replay_endpoints))]
    return Fleet(ups, model, w.block_size, engines.stop)


async def start_vllm(w: AgentWorkload, model: str) -> Fleet:
    """`w.engines` vLLM servers (their logs in $PREFIXGATE_VLLM_LOGS when it names a folder),
    KV cache blocks for `kv_share` of the sessions (`--num-gpu-blocks-override`)."""
    try:
        await asyncio.to_thread(vllm_install.ensure_vllm)
        model_dir = await asyncio.to_thread(vllm_install.prepare_model, model, VLLM_DTYPE)
        servers = real_vllm.vllm_servers(
            w.engines, model, dtype=VLLM_DTYPE, served_model_name=served_name(model),
            args=w.vllm_args(), kv_events=True, kvcache_gib=vllm_kv_gib(w, model_dir),
            log_dir=os.environ.get("PREFIXGATE_VLLM_LOGS") or None)
        started = await asyncio.to_thread(servers.__enter__)
    except vllm_install.VLLMUnavailable as e:
        raise RuntimeError(str(e)) from None
    ups = [{"name": f"vllm{i}", "url": s.url, "kv_events": s.kv_events}
           for i, s in enumerate(started)]

    async def stop() -> None:
        await asyncio.to_thread(servers.__exit__, None, None, None)
    return Fleet(ups, str(model_dir), VLLM_BLOCK, stop)


def vllm_kv_gib(w: AgentWorkload, model_dir: Path) -> int:
    """Whole GiB of KV cache (VLLM_CPU_KVCACHE_SPACE) for every session's last prompt."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    per_token = (cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim
                 * 2 * (4 if VLLM_DTYPE == "float32" else 2))
    tokens = w.sessions * (w.final_prompt_tokens() + w.answer_tokens + VLLM_BLOCK)
    return max(1, math.ceil(tokens * per_token / 2 ** 30))


async def run_mode(mode: str, w: AgentWorkload, lengths: Lengths, timeout: float, model: str,
                   salt: str = "") -> dict:
    """One run: engines with KV events, the replicas behind the balancer, every session."""
    fleet = await start_fleet(w, model)
    try:
        raw = gateway_config(fleet, w, MODES[mode], model, timeout)
        async with replicas_behind_balancer(raw, w.replicas) as (url, replica_urls):
            conversations = conversations_for(w, lengths, salt=f"{salt}:{mode}")
            turns: list[Turn] = []
            progress = archive_mod.Progress(w.sessions * w.turns, mode)
            # a connection of its own per request: the balancer sends each to the next replica
            async with target.client_session(timeout, force_close=True) as session:
                await asyncio.gather(*(
                    agent(session, url + conversations.path, s, w, conversations,
                          served_name(model), turns, progress) for s in range(w.sessions)))
                metrics = [await archive_mod.snapshot(session, u, "/metrics", {})
                           for u in replica_urls]
    finally:
        await fleet.stop()
    # (no warm API requests here: every warm request counted is a next turn's)
    return {"turns": turns, "gateway": raw,
            "warm": summed_all(metrics, "prefixgate_warm_requests_total", "outcome"),
            "sessions": summed_all(metrics, "prefixgate_route_sessions_total", "outcome")}


def gateway_config(fleet: Fleet, w: AgentWorkload, mode: Mode, model: str,
                   timeout: float) -> dict:
    """Every replica's config: the same, and nothing else shared."""
    routing = ({"prefix_route": {"policy": w.policy, "index": "kv_events",
                                 "block_tokens": fleet.block_tokens,
                                 "session": {"mode": w.session_mode}}}
               if mode.routing == "prefix_route" else {mode.routing: {}})
    return {"upstreams": fleet.upstreams,
            "models": {served_name(model): {"tokenizer": fleet.tokenizer}},
            "timeouts": {"first_byte": timeout, "idle": timeout},
            "plugins": [{"prerender": {"block_tokens": fleet.block_tokens,
                                       "warm_next_turn": mode.warm}},
                        routing, {"metrics": {}}]}


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
        history = await asyncio.to_thread(conversations.history, s, messages) if turn else 0
        sample = await stream_once(session, url, conversations.body(s, turn, messages, model),
                                   conversations.headers(s, turn),
                                   Sample(index=s * w.turns + turn, warmup=turn == 0),
                                   keep_text=True)
        turns.append(Turn(s, turn, history, sample))
        progress.step(sample.ok)
        if not sample.ok:
            return
        conversations.answered(s, turn, messages, "".join(sample.text))
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
    label = f"warming {mode}" if mode in ("off", "on") else mode
    cell = target.cell_record(label, {"mode": mode, "gateway": runs[0]["gateway"]},
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


def comparison(cells: list[dict]) -> dict | None:
    """prefixgate against round robin, where the run measured both: p95 TTFT of turns >= 2
    and its ratio, the least history any turn found cached, and the issue's targets."""
    by_mode = {c["mode"]: c for c in cells}
    if PREFIXGATE not in by_mode or BASELINE not in by_mode:
        return None
    ours, theirs = by_mode[PREFIXGATE], by_mode[BASELINE]
    p95, base = ours["summary"]["ttft_p95_ms"], theirs["summary"]["ttft_p95_ms"]
    ratio = round(p95 / base, 3) if p95 is not None and base else None
    shares = [v for v in ours["history_cached_by_turn"].values() if v is not None]
    least = min(shares) if shares else None
    return {"ttft_p95_ms": p95, "baseline_ttft_p95_ms": base, "p95_ratio": ratio,
            "least_history_cached_by_turn": least,
            "targets": {"history_cached_each_turn": TARGET_HISTORY, "p95_ratio": TARGET_RATIO},
            "met": {"history": least is not None and least >= TARGET_HISTORY,
                    "p95_ratio": ratio is not None and ratio <= TARGET_RATIO}}


def _kv_room(w: dict) -> str:
    share = w.get("kv_share")
    if share is None:
        return "each with KV room for every session's history"
    held = max(1, math.ceil(w["sessions"] * share))
    return f"each with KV room for {held} of the {w['sessions']} sessions' histories"


def print_agent(archive: dict) -> None:
    cfg = archive["config"]
    w = cfg["workload"]
    engine = "vLLM servers" if w.get("engine") == "vllm" else "bundled engines"
    if w.get("api") == "messages":
        shape = (f"Claude Code-shaped sessions over /v1/messages: a "
                 f"{cfg.get('prefix_tokens_built')}-token system prompt and tools "
                 f"({cfg['tool_tokens_built']} tokens of tool "
                 f"definitions, {w['kinds']} agent kinds) in a {w.get('context')}-token context, "
                 f"answers of up to {w['answer_tokens']} tokens")
    else:
        shape = (f"{cfg['tool_tokens_built']}-token tool definitions ({w['kinds']} agent kinds), "
                 f"{w['answer_tokens']}-token answers")
    print(f"\nagent sessions: {w['sessions']} sessions x {w['turns']} turns through "
          f"{w['replicas']} gateway replicas (a round-robin L4 balancer, a connection per "
          f"request) in front of {w['engines']} {engine} on the {cfg['model']} model, "
          f"{_kv_room(w)}; {shape}, "
          f"{w['tool_result_tokens']}-token tool results, tool pauses of "
          f"{w['think_ms'] / 1000:g} s and starts {w['start_gap_ms'] / 1000:g} s apart on "
          f"average; prefix_route {w['policy']} with {w.get('session_mode', 'soft')} sessions, "
          f"KV events (modes: off/on = next-turn warming; round-robin = round robin in place "
          f"of prefix_route). History cached: the share of each turn's history (the "
          f"conversation through the previous answer) the engine had cached; TTFT in ms over "
          f"turns 2-{w['turns']}")
    turn_heads = "".join(f"{'t' + str(n):>6}" for n in range(2, w["turns"] + 1))
    head = (f"{'mode':<12}{'history%':>9}{turn_heads}{'uncached':>9}{'p50':>7}{'p95':>7}"
            f"{'p99':>7}{'warmed':>7}{'dropped':>8}{'1-engine':>9}{'err':>5}")
    print(head + "\n" + "-" * len(head))
    for c in archive["cells"]:
        s = c["summary"]
        by_turn = c["history_cached_by_turn"]
        print(f"{c['mode']:<12}" + fmt(as_percent(c["history_cached"]), 9, 1)
              + "".join(fmt(as_percent(by_turn.get(n, by_turn.get(str(n)))), 6, 1)
                        for n in range(2, w["turns"] + 1))
              + fmt(c["uncached_tokens_per_turn_p50"], 9, 0)
              + "".join(fmt(s[f"ttft_p{q}_ms"], 7, 0) for q in (50, 95, 99))
              + fmt(int(c["warm"].get("warmed", 0)), 7) + fmt(int(c["warm"].get("dropped", 0)), 8)
              + fmt(f"{c['sessions_on_one_engine']}/{c['sessions']}", 9)
              + fmt(s["errors"], 5))
    cmp = archive.get("comparison")
    if cmp:
        ratio, least = cmp["p95_ratio"], cmp["least_history_cached_by_turn"]
        print(f"\np95 TTFT of turns >= 2: prefixgate {fmt(cmp['ttft_p95_ms'], 0, 0).strip()} ms, "
              f"round robin {fmt(cmp['baseline_ttft_p95_ms'], 0, 0).strip()} ms: ratio "
              f"{'-' if ratio is None else f'{ratio:.2f}'} (target <= {TARGET_RATIO:g}: "
              f"{'met' if cmp['met']['p95_ratio'] else 'NOT met'}); least history from cache "
              f"in a turn: {'-' if least is None else f'{100 * least:.1f}%'} (target >= "
              f"{100 * TARGET_HISTORY:g}%: {'met' if cmp['met']['history'] else 'NOT met'})")


def as_percent(share: float | None) -> float | None:
    """A share (0.25) as a percentage (25.0), for the table; not a percentile."""
    return None if share is None else 100.0 * share
