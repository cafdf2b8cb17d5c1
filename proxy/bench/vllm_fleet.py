"""`prefixgate bench --scenario seed --engine vllm`: the seed staircase with real vLLM servers
(vLLM's CPU build: proxy/testing/real_vllm.py) as the engines, and SGLang Model Gateway's
`cache_aware` router over the same two servers, so that the gateway's share of the cut is
measured on the engine people run, next to the router they would run instead.

    baseline            vLLM without prefix caching and without chunked prefill, round robin
    +prefix cache       vLLM's own switch (`--enable-prefix-caching`)
    +chunked prefill    vLLM's other one (`--enable-chunked-prefill`): vLLM as it ships
    +normalize          prefixgate moves the timestamp at the head of the system prompt to
                        its tail, so the tenants' prefixes become cacheable
    +affinity routing   prefix_route (cache_aware) keyed on the engines' own KV events
                        (`index: kv_events`, blocks of vLLM's 128 tokens, `prerender`
                        tokenizing as vLLM does)
    sglang cache_aware  SGLang Model Gateway (`--policy cache_aware`) in place of prefixgate,
                        over vLLM as it ships (the +chunked prefill engines)
    +PD disaggregation  only when `--stages` names it: one prefill and one decode server
                        instead of two mixed ones, the prompt's KV moved by vLLM's
                        NixlConnector (UCX over TCP on loopback: real_vllm.py), driven by the
                        gateway's `pd: {protocol: vllm}`. It runs, but far too slowly for the
                        staircase: here the prefill server took one 512-token prompt every
                        ~20-40 s with five waiting (with other vLLM servers on the same two
                        cores), so a stage of ~90 requests would not finish in a run.

The router comparison (the issue's first target) reads three rows of one run: round robin is
the +chunked prefill stage (vLLM as it ships behind a plain balancer), prefixgate is the
+affinity routing stage (the gateway as it is meant to run), SGLang is its own stage.

Left out: +KV offload tier. vLLM's KV offloading refuses to run without a GPU ("CPU
Offloading is currently only supported on CUDA-alike and XPU GPUs", vllm 0.32.0
v1/kv_offload/cpu/spec.py), so the P/D stage here has no second tier either.

The workload is the seed's, scaled to two vLLM servers on one core each (a cold 1,024-token
prompt takes ~1.1 s, a cached one ~0.1 s): 8 users pausing 4 s on average, 16 tenants, each
server's KV cache holding 3/4 of the tenants' prefixes in vLLM's 128-token blocks. The
servers' and the router's logs go to $PREFIXGATE_VLLM_LOGS when it names a folder.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path

from prefixgate.backend.config import served_name
from prefixgate.common.cache_root import cache_root
from prefixgate.common.processes import ServerProcess
from prefixgate.common.runtime import distinct_free_ports
from prefixgate.proxy.bench import seed
from prefixgate.proxy.bench.stats import fmt, reduction
from prefixgate.proxy.testing import real_vllm, vllm_install

SGLANG_ROUTER_VERSION = "0.3.2"
SGLANG = "sglang cache_aware"
ROUTERS = {"round robin": "+chunked prefill", "SGLang cache_aware": SGLANG,
           "prefixgate": "+affinity routing"}
VLLM_STAGES = [
    seed.Stage("baseline", False, False, False, "round_robin"),
    seed.Stage("+prefix cache", False, True, False, "round_robin"),
    seed.Stage("+chunked prefill", False, True, True, "round_robin"),
    seed.Stage("+normalize", True, True, True, "round_robin"),
    seed.Stage("+affinity routing", True, True, True, "prefix_route"),
    seed.Stage(SGLANG, False, True, True, "sglang"),
]
PD_STAGE = seed.Stage("+PD disaggregation", True, True, True, "prefix_route", pd=True)
DTYPE = "float32"


def vllm_workload() -> seed.Workload:
    return seed.Workload(concurrency=8, think_ms=4000.0, requests=48, warmup=24, rounds=1,
                         block_size=128, index="kv_events")


class VLLMEngines:
    """`vllm serve` processes in the shape target.start_engines expects (`urls`, `start`,
    `stop`), one per role, each bound to a core of its own."""

    def __init__(self, cfg: dict, kv_events: bool, log_dir: Path | None):
        self.cfg, self.kv_events_on, self.log_dir = cfg, kv_events, log_dir
        self.pd = "prefill" in cfg["roles"]       # every server can serve either leg
        self.urls: list[str] = []
        self.kv_events: list[dict | None] = []
        self.model_dir: Path | None = None
        self._servers = None

    async def start(self) -> None:
        servers = real_vllm.vllm_servers(
            len(self.cfg["roles"]), self.cfg["model"], dtype=DTYPE,
            served_model_name=served_name(self.cfg["model"]), args=self.cfg["args"],
            kv_events=self.kv_events_on, log_dir=self.log_dir, nixl=self.pd,
            timeout=self.cfg["startup_timeout_s"])
        try:
            started = await asyncio.to_thread(servers.__enter__)
        except vllm_install.VLLMUnavailable as e:
            raise RuntimeError(str(e)) from None
        self._servers = servers
        self.urls = [s.url for s in started]
        self.kv_events = [s.kv_events for s in started]
        self.model_dir = started[0].model_dir

    async def stop(self) -> None:
        servers, self._servers = self._servers, None
        if servers is not None:
            await asyncio.to_thread(servers.__exit__, None, None, None)


class VLLMFleet(seed.Fleet):
    """The seed's stages on vLLM servers; the SGLang stage puts SGLang's router in front."""

    engine = "vllm"
    stages = VLLM_STAGES
    named_only = [PD_STAGE]

    def __init__(self, log_dir: str | Path | None = None):
        super().__init__()
        self.log_dir = Path(log_dir) if log_dir else None

    def workload(self) -> seed.Workload:
        return vllm_workload()

    def engine_args(self, stage: seed.Stage, w: seed.Workload) -> list[str]:
        max_len = w.prompt_tokens + w.max_tokens + w.block_size   # room for the built prompts
        args = ["--max-model-len", str(max_len), "--max-num-seqs", str(w.concurrency),
                "--num-gpu-blocks-override", str(w.kv_blocks()),
                # the seed's requests carry tools, which vLLM refuses (400) without a tool
                # parser; SmolLM2 names none, and pythonic's needs no special tokens
                "--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]
        if not stage.prefix_cache:
            args.append("--no-enable-prefix-caching")
        if stage.chunked_prefill:
            return args + ["--enable-chunked-prefill",
                           "--max-num-batched-tokens", str(w.batched_tokens)]
        # unchunked, a step must take a whole prompt
        return args + ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max_len)]

    def launcher_for(self, stage: seed.Stage, w: seed.Workload):
        return lambda cfg: VLLMEngines(cfg, stage.reads_kv_events(w), self.log_dir)

    def gateway_config(self, stage, w, engines, timeout, model) -> dict:
        raw = super().gateway_config(stage, w, engines, timeout, model)
        if stage.reads_kv_events(w):
            for upstream, kv_events in zip(raw["upstreams"], engines.kv_events):
                upstream["kv_events"] = kv_events
            # prerender tokenizes with the very tokenizer and chat template vLLM loaded
            raw["models"] = {served_name(model): {"tokenizer": str(engines.model_dir)}}
        if stage.pd:
            raw["pd"] = {"protocol": "vllm"}
        return raw

    @contextlib.asynccontextmanager
    async def front(self, stage, w, engines, timeout, model):
        if stage.routing != "sglang":
            async with super().front(stage, w, engines, timeout, model) as front:
                yield front
            return
        router = SGLangRouter(engines.urls, w.balance_abs, self.log_dir)
        await asyncio.to_thread(router.start)
        try:
            yield router.url, {"router": router.command()}
        finally:
            await asyncio.to_thread(router.stop)

    def report(self, archive: dict) -> None:
        seed.print_staircase(archive)
        print_routers(archive)


def run_seed_vllm(args) -> int:
    """The staircase on vLLM (SmolLM2 unless `--model` names another model)."""
    args.model = args.model or "smollm2"
    return seed.run_seed(args, VLLMFleet(log_dir=os.environ.get("PREFIXGATE_VLLM_LOGS")))


# --- SGLang Model Gateway --------------------------------------------------------------------


def sglang_venv() -> Path:
    return cache_root() / f"sglang-router-{SGLANG_ROUTER_VERSION}"


def ensure_sglang_router(log=print) -> Path:
    """The python of a venv with sglang-router (its router is a Rust binary in the wheel),
    installed once per machine beside vLLM's venv."""
    python = sglang_venv() / "bin" / "python"
    marker = sglang_venv() / ".installed"
    if marker.is_file():
        return python
    with vllm_install.locked("sglang-router-install"):
        if not marker.is_file():
            log(f"installing sglang-router {SGLANG_ROUTER_VERSION} into {sglang_venv()}")
            vllm_install.run_checked([sys.executable, "-m", "venv", "--clear", str(sglang_venv())])
            vllm_install.run_checked([str(python), "-m", "pip", "install", "-q",
                            "--disable-pip-version-check",
                            f"sglang-router=={SGLANG_ROUTER_VERSION}"])
            marker.write_text(SGLANG_ROUTER_VERSION + "\n")
    return python


class SGLangRouter:
    """`python -m sglang_router.launch_router --policy cache_aware` over `workers`, with the
    same imbalance threshold as prefixgate's cache_aware (the two policies share their
    design); its other settings are SGLang's defaults."""

    def __init__(self, workers: list[str], balance_abs: float, log_dir: Path | None):
        self.workers, self.balance_abs, self.log_dir = workers, balance_abs, log_dir
        next_port = distinct_free_ports()
        self.port, self.metrics_port = next_port(), next_port()
        self.process: ServerProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [str(ensure_sglang_router()), "-m", "sglang_router.launch_router",
                "--host", "127.0.0.1", "--port", str(self.port), "--policy", "cache_aware",
                "--balance-abs-threshold", f"{self.balance_abs:g}", "--log-level", "warn",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
                "--worker-urls", *self.workers]

    def start(self, timeout: float = 120.0) -> None:
        """Ready once its workers registered (/readiness is 503 until one is healthy)."""
        self.process = ServerProcess(
            self.command(), self.url, what="SGLang's router", append_log=True,
            log=self.log_dir / "sglang-router.log" if self.log_dir else None).start()
        try:
            self.process.wait_ready(timeout, "/readiness")
        except RuntimeError:
            self.stop()
            raise RuntimeError(f"SGLang's router did not become ready at {self.url} "
                               f"({' '.join(self.command())})") from None

    def stop(self) -> None:
        """SIGTERM (it finishes its requests first), SIGKILL after 10 s."""
        process, self.process = self.process, None
        if process is not None:
            process.stop(10)


# --- the router comparison -------------------------------------------------------------------


def print_routers(archive: dict) -> None:
    """The three routers over the same vLLM servers, where the run measured them."""
    cells = {c["label"]: c for c in archive["cells"]}
    rows = [(name, cells[label]) for name, label in ROUTERS.items() if label in cells]
    if len(rows) < 2:
        return
    base = rows[0][1]["summary"]["ttft_p95_ms"]
    print(f"\nrouters over the same two vLLM servers (vLLM as it ships: prefix caching and "
          f"chunked prefill on); TTFT in ms; -p95%: vs {rows[0][0]}")
    head = f"{'router':<22}{'p50':>8}{'p95':>8}{'p99':>8}{'-p95%':>7}{'cached%':>8}{'err':>5}"
    print(head + "\n" + "-" * len(head))
    for name, c in rows:
        s = c["summary"]
        print(f"{name:<22}" + "".join(fmt(s[f"ttft_p{q}_ms"], 8, 0) for q in (50, 95, 99))
              + fmt(reduction(base, s["ttft_p95_ms"]), 7, 1)
              + fmt(seed.cached_share(c), 8, 0) + fmt(s["errors"], 5))

