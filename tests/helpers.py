"""Helpers for tests of several areas: the tree's paths, tiny random checkpoints made on the
fly, client-side SSE helpers, free ports, `prefixgate serve` in a child process, the engine's
server on a thread of its own, a DNS resolver a test steers, and prompts in prefix families."""
from __future__ import annotations

import asyncio
import functools
import gc
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import torch

from prefixgate.backend.cli import parse_args
from prefixgate.backend.demo import train_bpe_tokenizer, write_tokenizer_files
from prefixgate.backend.server import start_server
from prefixgate.common.runtime import free_port

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
CONF = ROOT / "conf"

# Modelled on Qwen2.5's template: default system prompt, tools as JSON lines, assistant
# tool_calls, consecutive tool results merged into one user turn, and a namespace() loop.
QWEN_STYLE_TEMPLATE = (DATA / "qwen_style_template.jinja").read_text("utf-8")


# --- tiny random Hugging Face checkpoints --------------------------------------------------
# `make_tiny_model(dir, kind)` saves a LlamaForCausalLM, Qwen2ForCausalLM or MistralForCausalLM
# built by transformers (safetensors weights, config.json) plus a byte-level BPE tokenizer and
# a ChatML chat template; both our engine and transformers load the same directory, and no
# test touches a hub.

VOCAB_SIZE = 384

_TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "A prefix cache keeps the keys and values of prompts that many requests share.",
    "Hello there! How are you today? I am fine, thank you, and you?",
    "Numbers like 1, 2, 3, 42 and 2024 appear in text; so do symbols: {} [] () <> # @.",
    "User asks a question and the assistant answers it clearly and briefly.",
    "你好，世界。今天天气很好，我们去公园散步吧。",
    "Emoji can appear too: 🙂 🚀 ✨ and accents: café, naïve, über.",
]


@functools.lru_cache(maxsize=1)
def _tiny_tokenizer_json() -> str:
    return train_bpe_tokenizer(_TRAINING_TEXT * 4, VOCAB_SIZE).to_str()


def tiny_tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_tiny_tokenizer_json())


def _hf_config(kind: str, eos_id: int, overrides: dict):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[kind]
    kwargs = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        # Wider than HF's 0.02 so random logits are well separated and greedy picks are stable.
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=None,
    )
    kwargs.update(overrides)
    return cls(**kwargs)


def make_tiny_model(dir: str | Path, kind: str = "llama", seed: int = 0,
                    max_shard_size: str | None = None, **overrides) -> Path:
    """Build and save a tiny random model of `kind` ("llama", "qwen2" or "mistral") in `dir`.

    `max_shard_size` (e.g. "100KB") saves a sharded checkpoint with an index.
    `overrides` go to the transformers config (e.g. tie_word_embeddings=True, rope_scaling=...,
    num_hidden_layers=3); weights are saved in float32.
    """
    from transformers import AutoModelForCausalLM

    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer()
    config = _hf_config(kind, tok.token_to_id("<|im_end|>"), overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        # HF initialises biases to zero, which would leave Qwen2's q/k/v bias path untested.
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    write_tokenizer_files(out, tok, model_max_length=config.max_position_embeddings)
    return out


# --- the client side of the OpenAI surface ------------------------------------------------

CHAT = {"model": "standin-model", "messages": [{"role": "user", "content": "hello"}]}


async def read_events(resp: aiohttp.ClientResponse) -> list[tuple[float, bytes]]:
    """(arrival time, event bytes) for each SSE event, split on blank lines as it arrives."""
    events, buf = [], b""
    async for chunk in resp.content.iter_any():
        now = time.monotonic()
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            events.append((now, event))
    return events


def event_json(event: bytes) -> dict | str:
    data = event.decode().removeprefix("data: ")
    return data if data == "[DONE]" else json.loads(data)


def assert_openai_error(payload: dict, status: int, resp_status: int) -> None:
    assert resp_status == status, payload
    assert set(payload) == {"error"}, payload
    assert {"message", "type", "code"} <= set(payload["error"]), payload
    assert isinstance(payload["error"]["message"], str) and payload["error"]["message"]


# Eight system prompts, each long enough to fill several prefix blocks, none a prefix of another.
FAMILIES = [f"You are assistant number {i}. " + f"Family {i} rules: answer briefly. " * 12
            for i in range(8)]


def body(system: str, user: str, **extra) -> dict:
    """A chat request with a system prompt and one user turn."""
    return {"model": "standin-model", "messages": [{"role": "system", "content": system},
                                                   {"role": "user", "content": user}], **extra}


async def post(client, url, payload, headers=None):
    """POST a chat to the gateway at `url`: (status, upstream chosen, route reason)."""
    async with client.post(url + "/v1/chat/completions", json=payload, headers=headers) as r:
        await r.read()
        return (r.status, r.headers.get("x-prefixgate-upstream"),
                r.headers.get("x-prefixgate-route"))


# --- servers --------------------------------------------------------------------------------

class Serving:
    """`prefixgate serve ARGS` in a child process; its URL (and the whole line, which names the
    bundled engines) read from the "listening on" line. On exit: SIGTERM, and exit status 0."""

    def __init__(self, *args, env: dict | None = None, timeout: float = 20):
        self.args, self.env, self.timeout = args, env, timeout
        self.output: list[str] = []

    async def __aenter__(self):
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "prefixgate.proxy.cli", "serve", *self.args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=self.env)
        try:
            while True:
                line = (await asyncio.wait_for(self.proc.stdout.readline(), self.timeout)).decode()
                assert line, "serve exited: " + "".join(self.output)
                self.output.append(line)
                if m := re.search(r"gateway listening on (http://\S+)", line):
                    self.url, self.line = m.group(1), line
                    return self
        except BaseException:
            if self.proc.returncode is None:
                self.proc.kill()
            await self.proc.wait()
            raise

    async def __aexit__(self, *exc):
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rest = (await asyncio.wait_for(self.proc.communicate(), 30))[0].decode()
        except asyncio.TimeoutError:
            self.proc.kill()
            raise
        assert self.proc.returncode == 0, "".join(self.output) + rest


class ServerThread:
    """The engine's real server on a loopback port, from a background thread with its own event
    loop (as a separate process would), so one server can be shared by a module's tests while
    each test runs on its own loop with a real HTTP client."""

    def __init__(self, argv: list[str], port: int = 0):
        self.argv = argv
        self.port = port                    # 0: a free one, then the one it got
        self.url: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        self._ready.wait(120)
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        # the engine (weights, a 1 GiB KV cache) sits in reference cycles with its event
        # loop: free it now, not at the next full collection, or a test run's memory grows
        # by an engine per module
        self.server = self._loop = None
        gc.collect()

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            server = await start_server(parse_args(self.argv), host="127.0.0.1",
                                        port=self.port)
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self.server = server
        self.url = server.url
        self.port = int(self.url.rsplit(":", 1)[1])
        self._ready.set()
        await self._stop.wait()
        await server.close()


class KVEventsEngine(ServerThread):
    """The engine's server and its KV event publisher (ZMQ, vLLM's format), on ports that stay
    the engine's across a restart (a new process on the same address, as a supervisor would
    start it)."""

    def __init__(self, model_dir, block: int, kv_blocks: int, port: int = 0, pub: int = 0,
                 replay: int = 0):
        self.pub, self.replay = pub or free_port(), replay or free_port()
        self.model_dir, self.block, self.kv_blocks = model_dir, block, kv_blocks
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events",
                  "endpoint": f"tcp://*:{self.pub}", "replay_endpoint": f"tcp://*:{self.replay}"}
        super().__init__(["--model", str(model_dir), "--dtype", "float32",
                          "--block-size", str(block), "--num-kv-blocks", str(kv_blocks),
                          "--step-overhead-tokens", "0", "--kv-events-config",
                          json.dumps(events)], port)

    @property
    def kv_events(self) -> dict:
        """The engine's `kv_events:` entry of a gateway upstream."""
        return {"endpoint": f"tcp://127.0.0.1:{self.pub}",
                "replay_endpoint": f"tcp://127.0.0.1:{self.replay}", "topic": "kv-events"}

    def restarted(self) -> KVEventsEngine:
        """Stop this engine; a new one on the same HTTP and KV event ports."""
        self.__exit__(None, None, None)
        return KVEventsEngine(self.model_dir, self.block, self.kv_blocks, self.port, self.pub,
                              self.replay).__enter__()


class Answers:
    """An injectable resolver: returns the latest answer, or raises it."""

    def __init__(self):
        self.now: list[str] | Exception = []
        self.calls = 0

    async def __call__(self, host, port, family):
        self.calls += 1
        if isinstance(self.now, Exception):
            raise self.now
        return list(self.now)


class RedisServer:
    """A real redis-server on a loopback port, with nothing saved to disk."""

    def __init__(self):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            ping = subprocess.run(["redis-cli", "-p", str(self.port), "ping"],
                                  capture_output=True, text=True)
            if ping.stdout.strip() == "PONG":
                return self
            time.sleep(0.05)
        raise AssertionError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


def whole_minute_ahead(needed_s: float = 8.0) -> None:
    """The store counts per wall-clock minute: start where the test ends in the same one."""
    left = 60 - time.time() % 60
    if left < needed_s:
        time.sleep(left + 0.05)
