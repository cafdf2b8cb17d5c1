"""The replay benchmark (backend/bench/replay.py) on the demo model: random prompts at a
Poisson rate straight into LLMEngine, its steps accounted for."""
from __future__ import annotations

import json

from prefixgate.backend.bench import replay


def test_replay_accounts_for_every_step_and_prompt_token(tmp_path, capsys):
    out = tmp_path / "replay.json"
    assert replay.main(["--num-prompts", "6", "--input-len", "200", "--output-len", "5",
                        "--rate", "20", "--max-num-batched-tokens", "256",
                        "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    decode, mixed = r["decode_only"], r["with_prompt_chunk"]
    # every prompt token is computed in some step (random prompts share no cached block), in
    # chunks no larger than the budget; the first output token comes with a prompt's last chunk
    # and the other 4 from steps that compute one token per sequence
    assert mixed["prompt_tokens"] == 6 * 200
    assert max(int(size) for size in mixed["chunk_sizes"]) <= 256
    assert mixed["steps"] >= 6 * 200 / 256
    assert decode["steps"] >= 4
    assert abs(decode["s"] + mixed["s"] - r["busy_s"]) < 1e-6
    assert 0 < r["busy_s"] <= r["wall_s"]
    assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p95"]
    assert r["tpot_ms"]["p50"] > 0
    assert "busy" in capsys.readouterr().out
