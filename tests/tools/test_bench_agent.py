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
