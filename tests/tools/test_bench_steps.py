"""`python -m prefixgate.backend.bench.steps` on the demo model: the engine's prefill and decode
steps timed as it serves them, beside the floors measured in the same run."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from prefixgate.backend.bench import steps


def run(tmp_path, *flags: str) -> tuple[dict, str]:
    out = tmp_path / "steps.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert steps.main(["--model", "demo", "--prefill-tokens", "64,256", "--batches", "1,4",
                           "--context", "96", "--repeats", "1", "--quick", *flags,
                           "--out", str(out)]) == 0
    return json.loads(out.read_text()), printed.getvalue()


def test_steps_are_timed_against_their_floors(tmp_path):
    result, printed = run(tmp_path, "--dtype", "float32")
    assert result["dtype"] == "float32" and result["limits"]["gemm_gflops"]["float32"] > 0
    prefill, decode = result["prefill"], result["decode"]
    assert set(prefill) == {"64", "256"} and set(decode) == {"1", "4"}
    # a floor is what the machine cannot beat: the fraction is floor / measured
    for row in prefill.values():
        assert 0 < row["floor_s"] and row["fraction"] == row["floor_s"] / row["s"]
    assert prefill["256"]["floor_s"] > prefill["64"]["floor_s"]
    for row in decode.values():
        assert 0 < row["floor_ms"] and abs(row["fraction"] - row["floor_ms"] / row["ms"]) < 1e-9
    assert "prefill    256 tokens" in printed and "decode batch   4 at 96" in printed
    assert set(result["mixed"]) == {"8"} and result["mixed"]["8"]["ms"] > 0
    assert "mixed: 8 decodes at 96 + a 48-token chunk over 48" in printed


def test_plain_skips_fusing_and_packing(tmp_path):
    result, printed = run(tmp_path, "--plain", "--batches", "1", "--prefill-tokens", "64",
                          "--mixed", "")
    assert result["packed_linears"] == 0 and "as loaded (--plain)" in printed
    assert result["mixed"] == {} and "mixed:" not in printed


def test_a_baseline_with_parts_off_is_timed_in_turns_beside_the_default(tmp_path):
    result, printed = run(tmp_path, "--baseline-plain", "few_rows,write_kv")
    assert result["config"]["baseline_plain"] == ["few_rows", "write_kv"]
    for row in result["decode"].values():
        assert row["baseline"] > 0 and row["speedup"] == row["baseline"] / row["ms"]
    for row in result["prefill"].values():
        assert row["speedup"] == row["baseline"] / row["s"]
    assert result["mixed"]["8"]["speedup"] == result["mixed"]["8"]["baseline"] / \
        result["mixed"]["8"]["ms"]
    assert "baseline: the same steps with few_rows, write_kv as PyTorch's" in printed
    assert "baseline" not in run(tmp_path)[0]["decode"]["1"]


def test_an_unknown_part_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        steps.main(["--baseline-plain", "few_rows,warp_drive"])
    assert exit_.value.code == 2
    assert "unknown part(s) ['warp_drive']: choose from elementwise" in capsys.readouterr().err
