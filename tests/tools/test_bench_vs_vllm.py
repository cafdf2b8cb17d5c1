"""`python -m prefixgate.backend.bench.vs_vllm --quick`: the bundled engine and real vLLM each
start on the same cores (one, or a set) from launch, every part runs against both, and the
side-by-side table and the JSON carry every figure of both; a tree that uses more than its cores
is caught, and a core that cannot be used is an error, not a tree left unpinned."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from prefixgate.backend.bench import pinned_servers, vs_vllm
from prefixgate.backend.bench.pinned_servers import CpuMeter, PinningError
from prefixgate.common.procfs import tree_pids
from prefixgate.proxy.bench.vllm_bench_client import BenchClient, run_vllm_bench

SPIN = "while :; do :; done"


def cores_here() -> list[int]:
    return sorted(os.sched_getaffinity(0))


two_cores = pytest.mark.skipif(len(cores_here()) < 2, reason="needs two cores")


@contextlib.contextmanager
def spinning_tree(spinners: list[int | None], outer: int | str | None = None):
    """A real process tree: a shell that starts one busy loop per entry of `spinners`, each
    under `taskset -c` its core (None: wherever the shell runs); the shell itself under
    `taskset -c outer` when given. Yields the shell's pid once the loops run; killed after."""
    # each loop a session of its own (`setsid`), so that on a busy machine the scheduler
    # weighs it as one more task group against the others (autogroups), not a share of one
    loops = " & ".join("setsid -w " + (f"taskset -c {c} " if c is not None else "")
                       + f"sh -c '{SPIN}'" for c in spinners)
    argv = ["sh", "-c", loops + " & wait"]
    if outer is not None:
        argv = ["taskset", "-c", str(outer), *argv]
    proc = subprocess.Popen(argv, start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        while len(tree_pids(proc.pid)) < 1 + len(spinners):
            assert time.monotonic() < deadline, "the busy loops did not start"
            time.sleep(0.05)
        time.sleep(0.2)                    # each loop exec'd and spinning
        yield proc.pid
    finally:
        # every process of the tree: the loops' own sessions are outside the shell's group,
        # and a loop left spinning would slow every test after this one
        for pid in tree_pids(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def metered(pid: int, seconds: float = 1.0) -> CpuMeter:
    meter = CpuMeter(pid, cores=1)
    with meter.part("spin"):
        time.sleep(seconds)
    return meter


@two_cores
def test_a_tree_on_two_cores_is_a_pinning_failure():
    a, b = cores_here()[:2]
    with spinning_tree([a, a, a, b, b, b]) as pid:      # three a core: a fair share of a busy one
        with pytest.raises(PinningError, match=f"not pinned to core {b}: .*cores {a}"):
            pinned_servers.check_pinned(pid, (b,))
        # the loops get more than one core's worth only while little else runs (CI runs two
        # test workers on two cores): a few half-second windows, until one shows it
        for _ in range(8):
            meter = metered(pid, 1.0)
            spin = meter.parts["spin"]
            if spin["cpu_s"] > 1.3 * spin["wall_s"] + 0.2:      # clearly more than one core
                break
        else:
            pytest.skip(f"this machine was too busy to give the loops two cores at once "
                        f"({spin['cpu_s']:.2f} CPU-s in {spin['wall_s']:.2f} s)")
    (line,) = meter.failures("spinner")
    assert line == (f"pinning failure: spinner used {spin['cpu_s']:.2f} CPU-s in "
                    f"{spin['wall_s']:.2f} wall-s (spin, 1 core)")


@two_cores
def test_a_tree_on_a_set_of_cores_may_use_each_and_no_more():
    a, b = cores_here()[:2]
    # threads bound to one core of the set, and one free to run on both, as vLLM's OpenMP
    # threads and its API server are
    with spinning_tree([a, b, None], outer=f"{a},{b}") as pid:
        pinned_servers.check_pinned(pid, (a, b))
        with pytest.raises(PinningError, match=f"not pinned to core {a}: .*cores {a},{b}"):
            pinned_servers.check_pinned(pid, (a,))
        meter = CpuMeter(pid, cores=2)
        with meter.part("spin"):
            time.sleep(1.0)
    assert meter.failures("spinner") == []


def test_a_cpu_list_is_read_as_taskset_writes_it():
    assert pinned_servers.cpu_list("1") == (1,)
    assert pinned_servers.cpu_list("1,0") == (0, 1)
    assert pinned_servers.cpu_list("0-2,5,2\n") == (0, 1, 2, 5)
    with pytest.raises(ValueError):
        pinned_servers.cpu_list("zero")


def test_the_slack_is_the_clock_ticks_rounding_and_no_more():
    tick = pinned_servers.CLOCK_TICK_S
    assert not pinned_servers.over_cores(1.0, 1.0, cores=1, processes=1)
    assert not pinned_servers.over_cores(1.05 + 0.05 + 2 * tick, 1.0, cores=1, processes=1)
    assert pinned_servers.over_cores(1.2, 1.0, cores=1, processes=1)
    assert not pinned_servers.over_cores(1.9, 1.0, cores=2, processes=3)


def test_a_tree_on_one_core_is_not_flagged():
    core = cores_here()[-1]                # off core 0, where others may be measuring
    with spinning_tree([None, None], outer=core) as pid:    # two loops share the core
        pinned_servers.check_pinned(pid, (core,))
        threads = pinned_servers.tree_threads(pid)
        meter = metered(pid)
    assert len(threads) >= 3 and all(p["threads"] == 1 and p["cores"] == [core]
                                     for p in threads)
    spin = meter.parts["spin"]
    assert 0 < spin["cpu_s"] and meter.failures("spinner") == []       # it ran, on one core


@two_cores
def test_an_unpinned_process_is_an_error_not_a_warning():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(PinningError, match=f"not pinned to core {cores_here()[-1]}: sleep"):
            pinned_servers.check_pinned(proc.pid, (cores_here()[-1],))
    finally:
        proc.kill()
        proc.wait()


def test_a_core_that_does_not_exist_is_an_error(capsys):
    core = max(pinned_servers.online_cores()) + 1
    with pytest.raises(PinningError, match=f"cannot pin to core {core}: this machine's online "
                                           "cores are 0"):
        pinned_servers.check_cores((core,))
    settings = pinned_servers.Settings("demo", "float32", (0, core), 512, 1024, 1)
    with pytest.raises(PinningError, match=f"cannot pin to core {core}"):
        with pinned_servers.ours(settings):
            pass
    assert vs_vllm.main(["--engines", "ours", "--model", "demo", "--core", str(core)]) == 1
    assert f"error: cannot pin to core {core}" in capsys.readouterr().err


def test_profile_without_py_spy_is_a_usage_error_before_anything_starts(monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SystemExit) as exit_:
        vs_vllm.parse_args(["--engines", "ours", "--profile", "/tmp/prof"])
    assert exit_.value.code == 2
    assert "--profile needs py-spy" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_quick_run_of_ours_alone_records_limits_cpu_seconds_and_threads(tmp_path, capsys):
    # on every core of this machine, a thread each: the client shares them
    out, cores = tmp_path / "vs.json", cores_here()
    assert vs_vllm.main(["--quick", "--engines", "ours", "--model", "demo",
                         "--cores", ",".join(map(str, cores)), "--parts", "ttft,decode",
                         "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    limits = result["limits"]["limits"]
    assert limits["cores"] == cores and limits["threads"] == len(cores)
    assert result["client_core"] is None
    assert result["cpu"]["model_name"] and "Flags" in result["cpu"]["lscpu"]
    assert result["floors"]["ttft"]["256"]["cold_s"] > 0
    ours = result["engines"]["ours"]
    assert set(ours["cpu"]) == {"warm-up", "ttft 256", "decode 1", "decode 4"}
    for part in ours["cpu"].values():
        assert 0 < part["cpu_s"] <= part["wall_s"] * len(cores) * 1.05 + 0.1
    for when in ("ready", "end"):
        (engine,) = ours["threads"][when]
        assert engine["threads"] >= len(cores) and engine["cores"] == cores
    fractions = ours["of_floor"]
    assert fractions["ttft"]["256"]["cold"] > 0 and fractions["decode"]["1"] > 0
    printed = capsys.readouterr()
    assert "CPU-s in" in printed.out
    if len(cores) > 1:
        assert f"cores {','.join(map(str, cores))} ({len(cores)} threads each)" in printed.out
        assert "warning: the client shares the engines' cores" in printed.err


@pytest.mark.vllm
@pytest.mark.timeout(900)
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
        # every process of the tree on core 0 from launch, and no part used more than it
        assert all(p["cores"] == [0] for p in figures["threads"]["ready"])
        assert all(p["cpu_s"] <= p["wall_s"] * 1.05 + 0.2 for p in figures["cpu"].values())
        assert set(figures["vllm_client"]) == {"prefix_repetition@2"}
        assert all(run["completed"] == 4 and run["request_throughput"] > 0
                   for run in figures["vllm_client"].values())
        assert figures["of_floor"]["ttft"]["256"]["cold"] > 0
    (chat,) = result["agreement"]
    assert chat["same_prompt_ids"]          # one tokenizer and one chat template on both sides
    printed = capsys.readouterr().out
    assert [row["label"] for row in result["rows"]][:7] == [
        "TTFT cold, 256 tokens", "TTFT cached prefix, 256 tokens (128 cached)",
        "decode tok/s, batch 1", "decode tok/s, batch 4",
        "short-request p95 TTFT behind a long prompt",
        "memory, process tree PSS", "memory, process tree RSS"]
    assert "vllm client prefix_repetition@2: TTFT p95" in [row["label"] for row in result["rows"]]
    assert result["rows"][0]["floor"] > 0 and set(result["rows"][0]["of_floor"]) == {"ours",
                                                                                     "vllm"}
    for row in result["rows"]:
        assert row["ours"] > 0 and row["vllm"] > 0 and row["ratio"] > 0
        assert row["label"] in printed
    assert "ratio: ours/vLLM in speed (>1: ours faster)" in printed


async def test_a_vllm_client_that_cannot_start_says_why():
    # a python without vLLM: the client's own traceback is in the error, no figures made up
    client = BenchClient(sys.executable).start()
    with pytest.raises(RuntimeError, match="(?s)exited with 1.*No module named 'vllm'"):
        await run_vllm_bench(sys.executable, ["--num-prompts", "1"], client)
    assert client.proc.returncode == 1
