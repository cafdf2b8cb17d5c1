"""`prefixgate bench --scenario agent` on real parts: two bundled engines (the demo model,
child processes publishing KV events over ZMQ), three gateway replicas behind the round-robin
TCP balancer, a connection per request, next-turn warming off and on."""
from __future__ import annotations

from prefixgate.proxy.bench import agent
from prefixgate.proxy.bench.prompts import Lengths, load_tokenizer


async def test_agent_sessions_find_their_history_cached_through_three_replicas(capsys):
    # hard sessions: on a busy machine soft ones may move when the other engine looks faster
    w = agent.AgentWorkload(sessions=3, turns=3, tool_tokens=300, kinds=2, task_tokens=24,
                            answer_tokens=24, tool_result_tokens=48, think_ms=300,
                            session_mode="hard")
    archive = await agent.run_modes(w, Lengths(load_tokenizer("demo")), 60.0, 500.0)
    off, on = archive["cells"]
    for cell in (off, on):
        assert cell["summary"]["errors"] == 0, cell["summary"]
        assert cell["summary"]["requests"] == 6      # turns 2 and 3 of three sessions
        # each session's turns reached different replicas, and every one of them sent it
        # to the same engine (rendezvous hashing of its x-session-id, nothing shared)
        assert cell["sessions_on_one_engine"] == cell["sessions"] == 3
        assert cell["route_sessions"].get("kept", 0) == 9
    assert off["warm"] == {}
    assert on["warm"].get("warmed", 0) >= 6          # (the last answers are warmed too)
    # without warming the engine computes the previous answer again with the new turn; with
    # it, the history is there before the turn comes
    assert on["history_cached"] >= 0.95, on["history_cached_by_turn"]
    assert on["history_cached"] > off["history_cached"]
    assert on["uncached_tokens_per_turn_p50"] < off["uncached_tokens_per_turn_p50"]
    agent.print_agent(archive)
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.startswith(("off", "on"))}
    assert rows["on"][-2] == "3/3" and rows["off"][-1] == "0"


async def test_claude_code_shaped_sessions_over_messages_against_round_robin(capsys):
    """`--api messages`: /v1/messages sessions as Claude Code sends them (system blocks with
    its billing header, Anthropic tools, tool_use / tool_result history, the session in
    x-claude-code-session-id and metadata.user_id), prefixgate against round robin."""
    w = agent.workload_for("messages", sessions=3, turns=3, kinds=2, prefix_tokens=400,
                           task_tokens=24, answer_tokens=24, tool_result_tokens=48,
                           think_ms=300, session_mode="hard")
    archive = await agent.run_modes(w, Lengths(load_tokenizer("demo")), 60.0, 500.0)
    on, rr = archive["cells"]
    assert (on["mode"], rr["mode"]) == ("on", "round-robin")
    for cell in (on, rr):
        assert cell["summary"]["errors"] == 0, cell["summary"]
        assert cell["summary"]["requests"] == 6      # turns 2 and 3 of three sessions
    # the usage came from Anthropic's events: every later turn's prompt and cache read
    assert all(s["prompt_tokens"] and s["cached_tokens"] is not None
               for s in on["samples"] if not s["warmup"])
    assert on["sessions_on_one_engine"] == on["sessions"] == 3
    assert on["route_sessions"].get("kept", 0) == 9
    assert on["warm"].get("warmed", 0) >= 6 and rr["warm"] == {} and rr["route_sessions"] == {}
    assert on["history_cached"] >= 0.95, on["history_cached_by_turn"]
    assert archive["config"]["workload"]["context"] == 16384          # the demo model's
    cmp = archive["comparison"]
    assert cmp["p95_ratio"] == round(on["summary"]["ttft_p95_ms"]
                                     / rr["summary"]["ttft_p95_ms"], 3)
    assert cmp["met"]["history"]
    agent.print_agent(archive)
    out = capsys.readouterr().out
    assert "over /v1/messages" in out and "p95 TTFT of turns >= 2: prefixgate" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.startswith(("on ", "round-robin "))}
    assert rows["on"][-2] == "3/3" and rows["round-robin"][-1] == "0"


def test_messages_sessions_fill_the_context_beside_ten_turns():
    """The default Messages workload: the system prompt and tools take what 10 turns leave of
    the model's context (demo: 16,384 tokens; SmolLM2's template leaves tools out, so its
    system prompt takes their share), and the last turn still fits."""
    lengths = Lengths(load_tokenizer("demo"))
    w = agent.workload_for("messages")
    w.fit_to(agent.model_context("demo"))
    assert (w.sessions, w.turns, w.context, w.tool_result_tokens) == (8, 10, 16384, 1024)
    conversations = agent.MessagesConversations(w, lengths, "t")
    built = conversations.built()
    assert abs(built["prefix_tokens_built"] - w.prefix_budget()) <= 8
    assert built["tool_tokens_built"] >= 0.7 * w.prefix_budget()
    messages = conversations.start(0)
    for turn in range(w.turns):
        body = conversations.body(0, turn, messages, "demo")
        conversations.answered(0, turn, messages, "word " * w.answer_tokens)
    assert body["system"][0]["text"].startswith("x-anthropic-billing-header")
    assert body["system"][-1]["cache_control"] == {"type": "ephemeral"}
    assert body["messages"][-1]["content"][-1]["cache_control"] == {"type": "ephemeral"}
    assert body["messages"][-2]["content"][-1]["type"] == "tool_use"
    assert "cache_control" not in body["messages"][-3]["content"][-1]
    last = conversations._rendered(body)
    assert w.prefix_budget() < last <= w.context - w.answer_tokens


async def test_the_bench_client_reads_a_messages_stream(make_standin):
    from prefixgate.proxy.bench.client import Sample, stream_once
    from prefixgate.proxy.bench.target import client_session
    standin = await make_standin(tokens=3, gap=0.01, prefix_cache=True)
    body = {"model": "standin-model", "max_tokens": 8, "stream": True,
            "system": "You are a coding agent. " * 20,
            "messages": [{"role": "user", "content": "hi"}]}
    async with client_session(30.0) as session:
        cold, warm = [await stream_once(session, standin.url + "/v1/messages", body, {},
                                        Sample(index=i), keep_text=True) for i in range(2)]
    for s in (cold, warm):
        assert s.ok and s.content_events == 3 and s.output_tokens == 3 and len(s.itl) == 2
        assert "".join(s.text) == "tok0 tok1 tok2 "
        assert s.prompt_tokens == cold.prompt_tokens > 100
    assert cold.cached_tokens == 0 and warm.cached_tokens > 100
    assert "message_usage" not in warm.to_json(0.0)
