"""`python -m prefixgate.backend.bench.vs_vllm --quick`: the bundled engine and real vLLM each
start pinned to one core, every part runs against both, and the side-by-side table and the
JSON carry every figure of both."""
from __future__ import annotations

import json

import pytest

from prefixgate.backend.bench import vs_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def test_quick_run_measures_both_engines_side_by_side(tmp_path, capsys):
    out = tmp_path / "vs.json"
    assert vs_vllm.main(["--quick", "--core", "0", "--out", str(out),
                         "--log-dir", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    sizes = vs_vllm.Sizes(quick=True)
    for name in ("ours", "vllm"):
        figures = result["engines"][name]
        answer = figures["agree"][0]
        assert answer["prompt_ids"] and 1 <= len(answer["ids"]) <= sizes.answer_tokens
        tier = figures["ttft"]["256"]
        # the prefix served just before is one whole 128-token block: both report it cached
        assert tier["prefix_tokens"] == 128 and tier["cached_tokens_reported"] == [128]
        assert 0 < tier["cached_prefix_s"] and 0 < tier["cold_s"]
        assert set(figures["decode"]) == {"1", "4"}
        assert all(d["tok_per_s"] > 0 for d in figures["decode"].values())
        assert figures["chunked"]["short_p95_ttft_s"] > 0
        assert figures["memory"]["processes"] >= 1 and figures["memory"]["pss_mib"] > 100
    (chat,) = result["agreement"]
    assert chat["same_prompt_ids"]          # one tokenizer and one chat template on both sides
    printed = capsys.readouterr().out
    assert [row["label"] for row in result["rows"]] == [
        "TTFT cold, 256 tokens", "TTFT cached prefix, 256 tokens (128 cached)",
        "decode tok/s, batch 1", "decode tok/s, batch 4",
        "short-request p95 TTFT behind a long prompt",
        "memory, process tree PSS", "memory, process tree RSS"]
    for row in result["rows"]:
        assert row["ours"] > 0 and row["vllm"] > 0 and row["ratio"] > 0
        assert row["label"] in printed
    assert "ratio: ours/vLLM in speed (>1: ours faster)" in printed
