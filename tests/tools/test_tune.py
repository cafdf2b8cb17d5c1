"""`prefixgate tune` end to end: the real command line, fresh bundled engines (the demo model)
per grid point, the table, the recommendation, the archive that `bench compare` reads; and
the grid's errors, before any engine starts."""
from __future__ import annotations

import itertools
import json

import pytest
import yaml

from prefixgate.proxy.bench.prompts import Lengths, load_tokenizer
from prefixgate.proxy.bench.quality import Gate
from prefixgate.proxy.bench.quality_prompts import Suite
from prefixgate.proxy.config import gateway as config_mod
from prefixgate.proxy.tune.cli import report
from prefixgate.proxy.tune.grid import GridError, Point, engine_flags, parse_grid
from prefixgate.proxy.tune.sweep import Workload, sweep
from tests.tools.helpers import run_cli

SMALL = ["--model", "demo", "--tiers", "96,192", "--concurrency", "2", "--requests", "6",
         "--warmup", "2", "--max-tokens", "4", "--threads", "1"]


async def test_tune_measures_each_point_on_a_fresh_engine_and_recommends_one(tmp_path):
    out = tmp_path / "tune.json"
    code, stdout, stderr = await run_cli(
        "tune", *SMALL, "--slo-ttft-ms", "30000",
        "--grid", "max_num_batched_tokens=32,256", "--out", str(out), "--plot",
        str(tmp_path / "tune.png"))
    assert code == 0, stderr
    assert (tmp_path / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    archive = json.loads(out.read_text())
    labels = [c["label"] for c in archive["cells"]]
    assert labels == ["defaults", "max_num_batched_tokens=32", "max_num_batched_tokens=256"]
    for c in archive["cells"]:
        s = c["summary"]
        assert s["requests"] == 6 and s["errors"] == 0, s
        assert set(s["ttft_p95_ms_by_tier"]) == {"96", "192"}
        assert s["meets_slo"] and s["goodput_frac"] == 1.0
        assert 0 < s["kv_usage_peak"] <= 1 and s["preemptions"] == 0
    assert [c["flags"] for c in archive["cells"]] == [
        [], ["--max-num-batched-tokens", "32"], ["--max-num-batched-tokens", "256"]]
    best = archive["recommended"]
    assert best["label"] in labels
    best_cell = next(c for c in archive["cells"] if c["label"] == best["label"])
    assert best_cell["summary"]["goodput_req_per_s"] == max(
        c["summary"]["goodput_req_per_s"] for c in archive["cells"])
    rows = {line.split()[0]: line for line in stdout.splitlines()
            if line.startswith(("defaults", "max_num"))}
    assert set(rows) == set(labels)
    assert f"recommended: {best['label']}" in stdout
    # the recommendation as the gateway's config: it validates
    block = itertools.takewhile(lambda line: line.startswith("    "),
                                stdout.split("gateway config:\n", 1)[1].splitlines())
    bundled = yaml.safe_load("\n".join(line[4:] for line in block))
    assert bundled["bundled"]["args"] == best["flags"]
    config_mod.validate(bundled)
    # `bench compare` reads the archive, cell by cell
    code, compared, _ = await run_cli("bench", "compare", str(out), str(out))
    assert code == 0 and "max_num_batched_tokens=256" in compared


async def test_the_budget_skips_what_it_cannot_fit_and_an_impossible_slo_recommends_nothing():
    code, stdout, stderr = await run_cli(            # (the budget: the defaults alone)
        "tune", *SMALL, "--slo-ttft-ms", "0.001", "--budget-min", "0.0001",
        "--grid", "max_num_seqs=2,4")
    assert code == 1, stderr
    assert stdout.count("skipped: over the budget") == 2 and "budget:" in stderr
    assert "none recommended" in stdout
    assert next(line for line in stdout.splitlines() if line.startswith("defaults")).split()[
        -2:] == ["no", "-"]                              # SLO missed, no gate needed


async def test_an_engine_command_template_runs_any_engine_on_your_prompts(tmp_path):
    """--engine-cmd with the bundled engine's own command line ({port}, {flags}, {model}),
    replaying request bodies from --prompts."""
    out, prompts = tmp_path / "cmd.json", tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"messages": [
        {"role": "user", "content": f"question {i}: " + "word " * 40}]}) for i in range(3)))
    args = [a for a in SMALL if a not in ("--tiers", "96,192")]
    code, stdout, stderr = await run_cli(
        "tune", *args, "--prompts", str(prompts), "--slo-ttft-ms", "30000",
        "--grid", "max_num_seqs=3",
        "--engine-cmd", "python -m prefixgate.backend --model {model} --port {port} {flags} "
        "--log-level warning", "--out", str(out))
    assert code == 0, stderr
    cells = json.loads(out.read_text())["cells"]
    assert [c["flags"] for c in cells] == [[], ["--max-num-seqs", "3"]]
    assert all(c["summary"]["errors"] == 0 for c in cells)
    assert all(set(c["summary"]["ttft_p95_ms_by_tier"]) == {"file"} for c in cells)
    assert all(50 < s["prompt_tokens"] < 70 for c in cells for s in c["samples"])


async def test_a_bad_prompts_file_names_its_line(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"input": "x"}\n')
    args = [a for a in SMALL if a not in ("--tiers", "96,192")]
    code, _, stderr = await run_cli("tune", *args, "--prompts", str(prompts),
                                    "--grid", "max_num_seqs=3")
    assert code == 2 and f"{prompts}:2: a request body needs `messages` or `prompt`" in stderr


@pytest.mark.parametrize("grid, message", [
    ("max_num_seqs", "is not name=value"),
    ("max_num_seqs=", "has no values"),
    ("max_num_seqs=4; max_num_seqs=8", "given twice"),
    ("max_num_seq=4", "'max_num_seq' is no engine setting"),
    ("max_num_seqs=many", "max_num_seqs takes an integer, got 'many'"),
    ("attention_backend=cuda", "attention_backend takes one of auto, triton, torch, got 'cuda'"),
])
def test_a_bad_grid_names_what_is_wrong(grid, message):
    with pytest.raises(GridError, match=message):
        parse_grid(grid)


async def test_a_bad_grid_fails_before_any_engine_starts():
    code, _, stderr = await run_cli("tune", *SMALL, "--grid", "max_num_seqs=abc")
    assert code == 2 and "max_num_seqs takes an integer, got 'abc'" in stderr


def test_points_are_the_cross_product_and_know_their_numerics():
    points = parse_grid("max_num_seqs=8,16; kv_cache_dtype=auto,fp8; enforce_eager=true,false;"
                        " attention_backend=available", attention_backends=["torch"])
    assert len(points) == 8
    p = points[2]
    assert p.label == ("max_num_seqs=8 kv_cache_dtype=fp8 enforce_eager=true "
                       "attention_backend=torch")
    assert p.flags() == ["--max-num-seqs", "8", "--kv-cache-dtype", "fp8", "--enforce-eager",
                         "--attention-backend", "torch"]
    assert p.numerics() == (("kv_cache_dtype", "fp8"), ("attention_backend", "torch"))
    # a switch set to false is left out; a numeric flag at its default is no change
    assert points[1].flags() == ["--max-num-seqs", "8", "--kv-cache-dtype", "auto",
                                 "--attention-backend", "torch"]
    assert points[1].numerics() == (("attention_backend", "torch"),)
    assert Point().label == "defaults" and Point().flags() == []
    # another engine's flags are its own: names as they are, switches given or left out
    assert engine_flags((("no_enable_prefix_caching", "true"), ("max_num_seqs", "8")),
                        bundled=False) == ["--no-enable-prefix-caching", "--max-num-seqs", "8"]


async def test_a_point_below_the_quality_gate_is_reported_never_recommended(tiny_llama_dir,
                                                                            capsys):
    """A planted fault (K/V kept with 1 mantissa bit) meets the SLO like the defaults, and is
    not recommended: the gate, against the defaults on the same prompts, fails it."""
    model = str(tiny_llama_dir)
    gate = Gate(model, [], suite=Suite(prompts=4, max_tokens=8, contexts=(256,), questions=2,
                                       answer_tokens=8), threads=1, timeout=120)
    w = Workload(tiers=[96], concurrency=2, requests=4, warmup=1, max_tokens=4,
                 slo_ttft_ms=30000, threads=1)
    archive = await sweep(parse_grid("debug_kv_mantissa_bits=1"), w,
                          Lengths(load_tokenizer(model)), model,
                          gate=lambda point: gate.check(point.flags()))
    defaults, fault = archive["cells"]
    assert defaults["summary"]["meets_slo"] and fault["summary"]["meets_slo"]
    assert defaults["gate"] is None                     # the defaults change no numerics
    assert not fault["gate"]["passed"]
    assert not fault["gate"]["metrics"]["top1_agreement"]["passed"]
    assert archive["recommended"]["label"] == "defaults"
    report(archive)
    out = capsys.readouterr().out
    assert "debug_kv_mantissa_bits=1: below the quality gate on" in out
    assert next(line for line in out.splitlines()
                if line.startswith("debug_kv_mantissa_bits=1")).endswith("FAIL")
