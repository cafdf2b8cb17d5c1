"""`prefixgate bench` against a stand-in upstream whose delays are known."""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import pytest

from prefixgate.backend.demo import train_bpe_tokenizer, write_tokenizer_files
from prefixgate.common.percentiles import percentile
from prefixgate.common.schema import check
from prefixgate.common.tokenizer import Tokenizer
from prefixgate.plugins.normalize.plugin import SPEC as NORMALIZE_SPEC
from prefixgate.plugins.normalize.plugin import Normalizer
from prefixgate.proxy.bench import cli as bench
from prefixgate.proxy.bench import seed as bench_seed
from prefixgate.proxy.bench.archive import SCHEMA, save_outputs
from prefixgate.proxy.bench.prompts import WORDS, Lengths, PromptSet, PromptSpec, load_tokenizer
from prefixgate.proxy.bench.stats import WARM_REQUESTS
from prefixgate.proxy.testing.standin import Behaviour, StandIn
from tests.tools.helpers import run_cli


async def test_bench_recovers_known_delays_and_archives_everything(make_standin, tmp_path):
    up = await make_standin(first_delay=0.15, gap=0.02, tokens=5)
    out = tmp_path / "run.json"
    rc, stdout, stderr = await run_cli(
        "bench", "--url", up.url + "/v1", "--tiers", "64,200", "--concurrency", "1,3",
        "--requests", "9", "--warmup", "2", "--max-tokens", "5", "--out", str(out))
    assert rc == 0, stderr
    assert "tier=200 c=3" in stdout and "ttft p50" in stdout
    archive = json.loads(out.read_text())
    assert archive["schema"] == SCHEMA
    assert archive["config"]["tiers"] == [64, 200] and archive["config"]["model"] == "standin-model"
    assert archive["environment"]["python"] and archive["environment"]["cpu_count"]
    assert archive["target"]["models"]["data"][0]["id"] == "standin-model"
    assert "vllm:num_requests_running" in archive["target"]["metrics_before"]
    assert [c["label"] for c in archive["cells"]] == [
        "tier=64 c=1", "tier=64 c=3", "tier=200 c=1", "tier=200 c=3"]
    for cell in archive["cells"]:
        s = cell["summary"]
        assert s["requests"] == 9 and s["errors"] == 0
        assert len(cell["samples"]) == 11 and sum(x["warmup"] for x in cell["samples"]) == 2
        # the stand-in waits 150 ms before its first event and 20 ms between events
        assert 145 <= s["ttft_p50_ms"] <= 240, s
        assert 18 <= s["tpot_p50_ms"] <= 45, s
        assert all(x["output_tokens"] == 5 for x in cell["samples"])
    # 2 + 9 requests per cell reached the stand-in, with the asked-for body
    assert len(up.requests) == 4 * 11
    sent = up.requests[-1]["json"]
    assert sent["stream"] is True and sent["max_tokens"] == 5 and sent["model"] == "standin-model"


async def test_bench_compare_prints_ratios(make_standin, tmp_path):
    fast = await make_standin(first_delay=0.05, record=False)
    slow = await make_standin(first_delay=0.2, record=False)
    common = ["--tiers", "32", "--concurrency", "2", "--requests", "6", "--warmup", "0"]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    (rc1, _, e1), (rc2, _, e2) = await asyncio.gather(
        run_cli("bench", "--url", slow.url, *common, "--out", str(a)),
        run_cli("bench", "--url", fast.url, *common, "--out", str(b)))
    assert rc1 == rc2 == 0, e1 + e2
    rc, stdout, _ = await run_cli("bench", "compare", str(a), str(b))
    assert rc == 0
    row = next(line for line in stdout.splitlines() if line.startswith("tier=32 c=2"))
    ratio_p50 = float(row.split()[-3])
    assert 0.15 < ratio_p50 < 0.45, row          # ~50 ms / ~200 ms
    rc, _, stderr = await run_cli("bench", "compare", str(a), str(tmp_path / "missing.json"))
    assert rc == 2 and "missing.json" in stderr


async def test_open_loop_arrivals_do_not_wait_for_responses(make_standin):
    up = await make_standin(first_delay=0.4, tokens=1)
    args = bench.parse_args([
        "--url", up.url, "--tiers", "16", "--rate", "25", "--requests", "12", "--warmup", "0"])
    t0 = time.monotonic()
    rc = await bench.run(args, Lengths())
    elapsed = time.monotonic() - t0
    assert rc == 0
    # closed-loop at concurrency 1 would take 12 x 0.4 s; Poisson arrivals at 25/s overlap
    assert elapsed < 2.5, elapsed
    starts = sorted(r["t"] for r in up.requests)
    assert starts[-1] - starts[0] < 1.6


async def test_users_pause_between_their_requests(make_standin):
    """--think-ms: each closed-loop user waits between a response and its next request."""
    up = await make_standin(first_delay=0.01, tokens=1, record=False)
    common = ["--url", up.url, "--tiers", "16", "--concurrency", "2", "--requests", "8",
              "--warmup", "0"]
    elapsed = {}
    for think in ("0", "200"):
        t0 = time.monotonic()
        assert await bench.run(bench.parse_args(common + ["--think-ms", think]), Lengths()) == 0
        elapsed[think] = time.monotonic() - t0
    # 2 users x 4 requests: back to back ~4 x 10 ms each; with pauses about 4 x 200 ms
    assert elapsed["200"] > elapsed["0"] + 0.3, elapsed
    with pytest.raises(SystemExit):
        bench.parse_args(common + ["--think-ms", "-1"])


async def test_errors_are_counted_and_reported(make_standin, capsys):
    up = await make_standin(fail="status", status=503)
    args = bench.parse_args([
        "--url", up.url, "--tiers", "16", "--concurrency", "1", "--requests", "3", "--warmup", "0"])
    assert await bench.run(args, Lengths()) == 1
    err = capsys.readouterr().err
    assert "3 errors" in err and "HTTP 503" in err and "stand-in failure" in err


async def test_unreachable_target_is_a_clear_error(tmp_path):
    rc, _, stderr = await run_cli("bench", "--url", "http://127.0.0.1:9", "--requests", "1")
    assert rc == 2 and "/v1/models gave no model" in stderr


async def test_plot_without_matplotlib_says_how_to_install(tmp_path):
    # a `matplotlib` that fails to import, first on the child's path: as if not installed
    (tmp_path / "matplotlib").mkdir()
    (tmp_path / "matplotlib" / "__init__.py").write_text("raise ImportError('not installed')\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prefixgate.proxy.cli", "bench", "--url", "http://127.0.0.1:9",
        "--plot", "x.png", env={**os.environ, "PYTHONPATH": str(tmp_path)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    assert proc.returncode == 2 and "prefixgate[plot]" in err.decode()


async def test_plot_draws_cdfs(make_standin, tmp_path):
    up = await make_standin(first_delay=0.01)
    png = tmp_path / "cdf.png"
    rc, _, stderr = await run_cli("bench", "--url", up.url, "--tiers", "16", "--concurrency",
                                  "1", "--requests", "4", "--warmup", "0", "--plot", str(png))
    assert rc == 0, stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    d = tmp_path_factory.mktemp("tok")
    text = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(0, len(WORDS), 7)] * 4
    write_tokenizer_files(d, train_bpe_tokenizer(text, vocab_size=600))
    return Tokenizer.from_dir(d)


@pytest.mark.parametrize("tier", [128, 700])
def test_prompt_tiers_are_exact_with_the_targets_tokenizer(tokenizer, tier):
    prompts = PromptSet(PromptSpec(tier, shared=0.8), Lengths(tokenizer))
    a, b = prompts.body(1), prompts.body(2)
    for body in (a, b):
        assert abs(prompts.measured_tokens(body) - tier) <= max(4, tier // 50)
    assert a["messages"][0] == b["messages"][0]              # the shared system prompt
    assert a["messages"][1]["content"][:20] != b["messages"][1]["content"][:20]
    # the per-request user message is the last 20% of the prompt
    user = len(tokenizer.encode(a["messages"][1]["content"]))
    assert abs(user - 0.2 * tier) <= max(3, tier // 50)


def test_dynamic_head_makes_every_system_prompt_unique():
    prompts = PromptSet(PromptSpec(200, shared=0.8, dynamic_head=True), Lengths())
    heads = {prompts.body(i)["messages"][0]["content"] for i in range(3)}
    assert len(heads) == 3
    assert all(h.startswith("Current time: ") for h in heads)
    # approximate lengths: one word = one token
    body = prompts.body(0)
    assert abs(prompts.measured_tokens(body) - 200) <= 4


def test_percentiles_interpolate_like_numpy():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 95) == pytest.approx(4.8)
    assert percentile([], 50) is None


# --- the seed scenario's machinery (the full staircase is a CLI run, not a test) -----------


def test_seed_prompts_share_each_tenants_prefix_once_normalized():
    w = bench_seed.Workload(prompt_tokens=300, tenants=3)
    lengths = Lengths(load_tokenizer("demo"))
    prompts = bench_seed.SeedPrompts(w, lengths)
    bodies = [prompts.body(i) for i in range(12)]
    tenants = {b["tools"][0]["function"]["name"].split("_")[0] for b in bodies}
    assert len(tenants) == 3                                  # drawn at random, all used
    for b in bodies:
        assert b["messages"][0]["content"].startswith("Current time: ")
        assert abs(prompts.sets[0].measured_tokens(b) - 300) <= 12
    norm = Normalizer(check({"learn": False}, NORMALIZE_SPEC))
    by_tenant = {}
    for b in bodies:
        norm.normalize(b)
        by_tenant.setdefault(b["tools"][0]["function"]["name"], set()).add(
            b["messages"][0]["content"])
    assert all(len(systems) == 1 for systems in by_tenant.values())
    assert len({s for systems in by_tenant.values() for s in systems}) == 3


def test_seed_kv_budget_holds_a_share_of_the_tenants():
    w = bench_seed.Workload()
    prefix = int(w.prompt_tokens * w.shared) // w.block_size
    per_prompt = -(-w.prompt_tokens // w.block_size) + 1
    kv = w.kv_blocks()
    assert kv >= w.concurrency * per_prompt                       # every in-flight prompt fits
    room = kv - w.concurrency * (per_prompt - prefix)
    assert room // prefix == int(w.tenants * w.cached_tenants)    # ... and 3/4 of the tenants


class StandInEngines:
    """Stand-ins in place of engine processes: prefill costs time per uncached token and the
    prefix cache follows the stage's engine flags."""

    def __init__(self, cfg):
        self.cfg, self.standins, self.urls = cfg, [], []

    async def start(self):
        cache = "--no-prefix-caching" not in self.cfg["args"]
        for _ in range(self.cfg["instances"]):
            s = await StandIn(Behaviour(model="demo", tokens=2, prefix_cache=cache,
                                        prefill_per_token=0.0004, record=False)).start()
            self.standins.append(s)
            self.urls.append(s.url)

    async def stop(self):
        for s in self.standins:
            await s.stop()


async def test_seed_stages_run_behind_the_gateway(capsys, tmp_path):
    w = bench_seed.Workload(prompt_tokens=400, tenants=4, requests=6, warmup=6, concurrency=2,
                            think_ms=50, max_tokens=2, rounds=2)
    stages = [s for s in bench_seed.STAGES if s.name in ("baseline", "+prefix cache",
                                                          "+affinity routing")]
    args = bench.parse_args(["--scenario", "seed"])
    archive = await bench_seed.run_stages(w, stages, Lengths(load_tokenizer("demo")), args,
                                          launcher=StandInEngines)
    bench_seed.print_staircase(archive)
    base, cached, routed = archive["cells"]
    assert [c["label"] for c in archive["cells"]] == ["baseline", "+prefix cache",
                                                     "+affinity routing"]
    assert ("--no-prefix-caching" in base["engine_args"]
            and "--no-chunked-prefill" in base["engine_args"])
    assert base["gateway"]["plugins"] == [{"round_robin": {}}, {"metrics": {}}]
    assert {"normalize": {}} in cached["gateway"]["plugins"]
    assert routed["gateway"]["plugins"][1] == {"prefix_route": {
        "policy": "cache_aware", "balance_abs_threshold": w.balance_abs}}
    assert sum(e["prefix_hits"] for e in base["engines"]) == 0
    assert sum(e["prefix_hits"] for e in cached["engines"]) > 0
    assert set(routed["routes"]) <= {"cache", "new", "balance", "nokey"} and routed["routes"]
    for c in archive["cells"]:      # two rounds pooled, each with its own engines
        assert c["summary"]["requests"] == 12 and c["summary"]["errors"] == 0
        assert len(c["engines"]) == 4 and len(c["samples"]) == 24
    # ~400 uncached tokens x 0.4 ms in the baseline; ~20% of that once the prefix is cached
    assert cached["summary"]["ttft_p50_ms"] < 0.6 * base["summary"]["ttft_p50_ms"]
    out = capsys.readouterr().out
    assert "seed staircase" in out and "2 users pausing 0.05 s on average" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.startswith(("baseline", "+prefix", "+affinity"))}
    assert rows["baseline"][-3] == "12"             # no prefix cache: every request misses
    assert int(rows["+prefix"][-3]) < 12 and rows["+affinity"][-1] == "0"
    save_outputs(archive, str(tmp_path / "seed.json"), str(tmp_path / "seed.png"))
    saved = json.loads((tmp_path / "seed.json").read_text())
    assert saved["kind"] == "seed" and saved["config"]["workload"]["think_ms"] == 50
    assert (tmp_path / "seed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_seed_reports_how_well_predicted_ttft_predicted(capsys):
    """The route header's prediction against the TTFT the client measured, each engine's first
    WARM_REQUESTS left out; cache_aware predicts nothing, so its stage reports no error."""
    w = bench_seed.Workload(prompt_tokens=400, tenants=4, requests=110, warmup=6,
                            concurrency=2, think_ms=0, max_tokens=2, rounds=1)
    stage = next(s for s in bench_seed.STAGES if s.name == "+affinity routing")
    cells = {}
    for policy in ("predicted_ttft", "cache_aware"):
        w.policy = policy
        args = bench.parse_args(["--scenario", "seed"])
        archive = await bench_seed.run_stages(w, [stage], Lengths(load_tokenizer("demo")), args,
                                              launcher=StandInEngines)
        bench_seed.print_staircase(archive)
        cells[policy] = archive["cells"][0]
    predicted = cells["predicted_ttft"]
    per_engine = {}
    for x in predicted["samples"]:
        per_engine[x["upstream"]] = per_engine.get(x["upstream"], 0) + 1
        assert x["predicted_ttft_ms"] > 0, x
    warm = sum(max(n - WARM_REQUESTS, 0) for n in per_engine.values())
    summary = predicted["summary"]
    assert summary["prediction_error_n"] == warm > 0, per_engine
    assert 0 <= summary["prediction_error_p50"] < 1
    assert "prediction_error_p50" not in cells["cache_aware"]["summary"]
    assert all(x["predicted_ttft_ms"] is None for x in cells["cache_aware"]["samples"])
    out = capsys.readouterr().out
    assert f"median |predicted - TTFT| / TTFT {100 * summary['prediction_error_p50']:.1f}% " \
           f"over {warm} requests" in out


async def test_every_request_of_a_run_is_its_own(make_standin):
    """No two requests share their per-request part, across cells too (else a later cell
    would be measured against the prefix cache the earlier one filled)."""
    up = await make_standin()
    args = bench.parse_args(["--url", up.url, "--tiers", "40", "--concurrency", "1,2",
                             "--requests", "5", "--warmup", "2"])
    assert await bench.run(args, Lengths()) == 0
    users = [r["json"]["messages"][1]["content"] for r in up.requests]
    assert len(users) == 14 and len(set(users)) == 14
    assert len({r["json"]["messages"][0]["content"] for r in up.requests}) == 1   # shared


class PDStandInEngines:
    """Stand-ins for engines with roles: vLLM-like prefill and decode instances sharing one
    KV store (proxy/testing/pd_standin.py), plain stand-ins for `both`."""

    def __init__(self, cfg):
        from prefixgate.proxy.testing.pd_standin import KVStore, VllmDecode, VllmPrefill
        self.cfg, self.standins, self.urls = cfg, [], []
        kv = KVStore()
        self.kinds = {"prefill": lambda b: VllmPrefill(b, kv=kv),
                      "decode": lambda b: VllmDecode(b, kv=kv), "both": StandIn}

    async def start(self):
        for role in self.cfg["roles"]:
            b = Behaviour(model="demo", tokens=4, gap=0.002, record=False)
            s = await self.kinds[role](b).start()
            self.standins.append(s)
            self.urls.append(s.url)

    async def stop(self):
        for s in self.standins:
            await s.stop()


async def test_seed_pd_stage_runs_a_prefill_and_a_decode_engine(tmp_path):
    w = bench_seed.Workload(prompt_tokens=300, tenants=2, requests=4, warmup=2, concurrency=2,
                            think_ms=20, max_tokens=2, rounds=1)
    stage = next(s for s in bench_seed.STAGES if s.name == "+PD disaggregation")
    args = bench.parse_args(["--scenario", "seed"])
    archive = await bench_seed.run_stages(w, [stage], Lengths(load_tokenizer("demo")), args,
                                          launcher=PDStandInEngines)
    cell = archive["cells"][0]
    assert cell["gateway"]["pd"] == {"protocol": "prefixgate"}
    assert [u["role"] for u in cell["gateway"]["upstreams"]] == ["prefill", "decode"]
    assert cell["summary"]["errors"] == 0 and cell["summary"]["requests"] == 4


async def test_mixed_scenario_runs_both_layouts(capsys):
    from prefixgate.proxy.bench import mixed

    w = mixed.MixedWorkload(decoders=2, decoder_prompt_tokens=32, decoder_tokens=4,
                            long_prompt_tokens=200, long_requests=3, rate=20.0)
    archive = await mixed.run_layouts(w, Lengths(load_tokenizer("demo")), 30.0, 500.0,
                                      launcher=PDStandInEngines)
    mixed.print_mixed(archive)
    cells = {(c["layout"], c["kind"]): c["summary"] for c in archive["cells"]}
    assert set(cells) == {("mixed", "long"), ("mixed", "decode"), ("pd", "long"),
                          ("pd", "decode")}
    for (layout, kind), s in cells.items():
        assert s["errors"] == 0, (layout, kind)
    assert cells[("pd", "long")]["requests"] == 3 and cells[("pd", "decode")]["requests"] > 0
    out = capsys.readouterr().out
    assert "layout" in out and "\npd " in out and "\nmixed " in out
