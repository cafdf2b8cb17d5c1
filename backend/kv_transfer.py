"""Prefill → decode KV hand-over between engines, in vLLM's KV-connector flow (NixlConnector's
`kv_transfer_params`), over a direct engine-to-engine TCP connection.

Leg 1, on a prefill engine (`--role prefill` or `both`): a request with `kv_transfer_params:
{"do_remote_decode": true, ...}` (and `stream: false`) runs as usual — its prefix cache hits
count — and its answer carries `kv_transfer_params: {"do_remote_prefill": true, "remote_engine_id",
"remote_block_ids", "remote_host", "remote_port", "transfer_id", "num_tokens", ...}`. Its
sequence's blocks stay referenced (`Scheduler.held`) until a decode engine has pulled them or
`--kv-transfer-timeout` seconds have passed, then they are freed. A handle is pulled once.

Leg 2, on a decode engine (`--role decode` or `both`): the client's body plus those params. The
decode engine allocates the prompt's blocks (taking what its own prefix cache holds), pulls the
rest from the prefill engine's KV server, writes them into its paged cache between two steps,
enters the full blocks in its prefix cache, and schedules the sequence with all but the last
prompt token computed: its first step is that one token, as a decode, which samples the first
output token (vLLM does the same: the connector loads every prompt token, the scheduler then
recomputes the last one for its logits). Greedy output is the same as one engine doing both.
Any failure is an OpenAI error before the first byte (nothing is recomputed silently); what was
allocated is freed.

The wire protocol, one connection per pull; a frame is a kind byte and a 64-bit big-endian
length, then the payload:
  decode → prefill  J {"op": "pull", "version", "transfer_id", "engine_id", "first_block",
                       "num_tokens", "prompt_hash", "layout"}
  prefill → decode  J {"ok": true, "num_blocks", "layer_bytes"} or {"ok": false, "code", "message"}
  prefill → decode  one D frame per layer: the blocks' K rows then V rows, raw bytes of the cache
                    dtype (FP8 moves as FP8), blocks [first_block, ceil(num_tokens / block_size))
  decode → prefill  J {"op": "done"}: the prefill engine frees the blocks (also on a dropped link)
`layout` (model shape, layers, KV heads, head size, block size, KV dtype) must match exactly.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import time
import uuid
from array import array
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from prefixgate.backend.async_engine import AsyncEngine, RequestStream
from prefixgate.backend.config import ROLES
from prefixgate.backend.sampling import SamplingParams
from prefixgate.backend.sequence import Sequence
from prefixgate.common.errors import HTTPError

log = logging.getLogger("prefixgate.kv_transfer")

PROTOCOL_VERSION = 1
FRAME = struct.Struct("!cQ")           # kind, payload length
MAX_CONTROL_BYTES = 1 << 20            # a J frame larger than this is a protocol error
READ_LIMIT = 4 << 20                   # the pulling side's stream buffer
MIN_READ_TIMEOUT_S = 5.0               # the KV server waits at least this for a message


class KVTransferError(Exception):
    """A pull that failed; `code` says why (the decode engine's answer carries it)."""

    def __init__(self, code: str, message: str, status: int = 502):
        super().__init__(message)
        self.code = code
        self.status = status

    def http(self) -> HTTPError:
        return HTTPError(self.status, f"KV transfer failed: {self}", code=self.code)


# --- kv_transfer_params ------------------------------------------------------------------------

@dataclass
class RemoteDecode:
    """Leg 1: compute the prompt here and hold its KV for a decode engine."""


@dataclass
class RemotePrefill:
    """Leg 2: the prompt's KV is on another engine; pull it."""
    engine_id: str
    host: str
    port: int
    transfer_id: str
    block_ids: list[int]
    num_tokens: int | None


def parse_params(body: dict) -> RemoteDecode | RemotePrefill | None:
    """A request's `kv_transfer_params`; None for a plain request. Bad fields are a 400 naming
    them."""
    p = body.get("kv_transfer_params")
    if p is None:
        return None
    if not isinstance(p, dict):
        raise _bad("kv_transfer_params", "an object", p)
    decode, prefill = _flag(p, "do_remote_decode"), _flag(p, "do_remote_prefill")
    if decode and prefill:
        raise HTTPError(400, "'kv_transfer_params': do_remote_decode and do_remote_prefill "
                        "cannot both be true", code="invalid_value")
    if decode:
        return RemoteDecode()
    if not prefill:
        return None
    tid = p.get("transfer_id", p.get("remote_request_id"))
    if not isinstance(tid, str) or not tid:
        raise _bad("transfer_id", "a non-empty string (the transfer_id leg 1 returned)", tid)
    port = p.get("remote_port")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise _bad("remote_port", "a port number (1..65535)", port)
    ids = p.get("remote_block_ids")
    if not isinstance(ids, list) or not all(isinstance(b, int) and not isinstance(b, bool)
                                            for b in ids):
        raise _bad("remote_block_ids", "a list of integers", ids)
    n = p.get("num_tokens")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise _bad("num_tokens", "a positive integer", n)
    return RemotePrefill(engine_id=_string(p, "remote_engine_id"), host=_string(p, "remote_host"),
                         port=port, transfer_id=tid, block_ids=ids, num_tokens=n)


def _flag(p: dict, name: str) -> bool:
    value = p.get(name)
    if value is not None and not isinstance(value, bool):
        raise _bad(name, "a boolean", value)
    return bool(value)


def _string(p: dict, name: str) -> str:
    value = p.get(name)
    if not isinstance(value, str) or not value:
        raise _bad(name, "a non-empty string", value)
    return value


def _bad(name: str, what: str, value) -> HTTPError:
    field = name if name == "kv_transfer_params" else f"kv_transfer_params.{name}"
    return HTTPError(400, f"'{field}' must be {what}, got {json.dumps(value)[:80]}",
                     code="invalid_value")


# --- shared ------------------------------------------------------------------------------------

def kv_layout(engine) -> dict:
    """What two engines must agree on for their KV blocks to be interchangeable."""
    c = engine.model_config
    return {"model_type": c.model_type, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "num_layers": c.num_hidden_layers, "num_kv_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "block_size": engine.args.block_size,
            "kv_dtype": str(engine.runner.kv_caches[0][0].dtype).removeprefix("torch.")}


def prompt_hash(token_ids) -> int:
    return xxhash.xxh64_intdigest(array("q", token_ids).tobytes())


def block_bytes(engine) -> int:
    """Bytes of one block of one layer's K (or V) cache."""
    k = engine.runner.kv_caches[0][0]
    return k[0].numel() * k.element_size()


async def _read_frame(reader: asyncio.StreamReader) -> tuple[bytes, int]:
    kind, n = FRAME.unpack(await reader.readexactly(FRAME.size))
    return kind, n


async def _read_json(reader: asyncio.StreamReader) -> dict:
    kind, n = await _read_frame(reader)
    if kind != b"J" or n > MAX_CONTROL_BYTES:
        raise KVTransferError("kv_protocol_error",
                              f"expected a control frame, got {kind!r} of {n} bytes")
    msg = json.loads(await reader.readexactly(n))
    if not isinstance(msg, dict):
        raise KVTransferError("kv_protocol_error", "a control frame is not a JSON object")
    return msg


def _write_json(writer: asyncio.StreamWriter, msg: dict) -> None:
    data = json.dumps(msg).encode()
    writer.write(FRAME.pack(b"J", len(data)) + data)


@dataclass
class KVTransferStats:
    served: int = 0                # pulls this engine answered in full (prefill side)
    pulled: int = 0                # pulls this engine made (decode side)
    failed: int = 0                # pulls that failed, either side
    expired: int = 0               # holds freed by the timeout, never pulled
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds_sent: float = 0.0
    seconds_pulled: float = 0.0


@dataclass
class _Hold:
    seq: Sequence
    num_blocks: int                # the prompt's blocks, the ones a pull sends
    prompt_hash: int
    timer: asyncio.TimerHandle


# --- both sides --------------------------------------------------------------------------------

class KVTransfer:
    """One engine's side of KV hand-over: its holds and KV server (prefill, both) and its pulls
    (decode, both). Lives on the server's event loop; block-manager work runs on the engine
    thread, between steps (`AsyncEngine.call`)."""

    def __init__(self, engine: AsyncEngine, host: str):
        self.engine = engine
        self.core = engine.engine
        args = self.core.args
        if args.role not in ROLES:
            raise ValueError(f"--role {args.role!r}: use one of {', '.join(ROLES)}")
        if args.kv_transfer_timeout <= 0:
            raise ValueError("--kv-transfer-timeout must be positive")
        self.role = args.role
        self.timeout = float(args.kv_transfer_timeout)
        # how long the KV server waits for a puller's next message: the hold's timeout, but
        # never so short that a busy decode engine's request counts as silence (a hold that
        # expired must be answered "not found", not with a dropped connection)
        self._read_timeout = max(self.timeout, MIN_READ_TIMEOUT_S)
        self.host = args.kv_transfer_host or host
        self.port = args.kv_transfer_port
        self.engine_id = uuid.uuid4().hex
        self.layout = kv_layout(self.core)
        self.block_bytes = block_bytes(self.core)
        self.stats = KVTransferStats()
        self._holds: dict[str, _Hold] = {}
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()

    @property
    def serves(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def pulls(self) -> bool:
        return self.role in ("decode", "both")

    async def start(self) -> None:
        """A prefill engine (or one given --kv-transfer-port) listens from the start; a `both`
        engine opens its KV port only when it is first asked to prefill for a remote decode,
        so an engine nobody uses for P/D keeps no extra (unauthenticated) port open."""
        if self.role == "prefill" or (self.serves and self.port):
            await self.listen()

    async def listen(self) -> None:
        """Open the KV server (once)."""
        if self._server is not None or not self.serves:
            return
        self._server = await asyncio.start_server(self._serve_pull, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("KV transfer server (engine %s) at %s:%d", self.engine_id, self.host, self.port)

    async def close(self) -> None:
        for tid in list(self._holds):
            self._holds.pop(tid).timer.cancel()
        if self._server is not None:
            self._server.close()
            for w in list(self._conns):
                w.close()
            await self._server.wait_closed()
            self._server = None

    # --- prefill side: holds ---------------------------------------------------------------

    @staticmethod
    def new_transfer_id() -> str:
        return "kvx-" + uuid.uuid4().hex

    def hand_over(self, tid: str) -> dict | None:
        """Leg 1 finished: offer its held blocks for one pull (until the timeout); the answer's
        `kv_transfer_params`. None if the engine holds nothing under `tid`."""
        seq = self.core.scheduler.held.get(tid)
        if seq is None:
            return None
        n = seq.num_prompt_tokens
        num_blocks = -(-n // self.core.args.block_size)
        timer = asyncio.get_running_loop().call_later(self.timeout, self._expire, tid)
        self._holds[tid] = _Hold(seq, num_blocks, prompt_hash(seq.token_ids[:n]), timer)
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.engine_id,
                "remote_block_ids": seq.block_table[:num_blocks],
                "remote_host": self._advertised_host(), "remote_port": self.port,
                "remote_request_id": tid, "transfer_id": tid, "num_tokens": n, "tp_size": 1}

    def settle(self, tid: str) -> None:
        """Leg 1's handler is done: blocks it did not hand over (the client left) are freed
        now."""
        if tid not in self._holds:
            self.engine.release_kv(tid)

    def _expire(self, tid: str) -> None:
        if self._holds.pop(tid, None) is not None:
            self.stats.expired += 1
            log.info("KV transfer %s expired after %.1fs without a pull; blocks freed",
                     tid, self.timeout)
            self.engine.release_kv(tid)

    def _advertised_host(self) -> str:
        return socket.gethostname() if self.host in ("", "0.0.0.0", "::") else self.host

    # --- prefill side: the KV server -------------------------------------------------------

    async def _serve_pull(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        hold, tid, t0, sent = None, None, time.monotonic(), 0
        try:
            msg = await asyncio.wait_for(_read_json(reader), self._read_timeout)
            tid = msg.get("transfer_id")
            problem = self._check_pull(msg)
            if problem is not None:
                code, message = problem
                _write_json(writer, {"ok": False, "code": code, "message": message})
                await writer.drain()
                return
            hold = self._holds.pop(tid)
            hold.timer.cancel()
            sent = await self._send_blocks(writer, hold, msg["first_block"])
            done = await asyncio.wait_for(_read_json(reader), self._read_timeout)
            if done.get("op") != "done":
                raise KVTransferError("kv_protocol_error",
                                      f"expected 'done', got {done.get('op')!r}")
            self.stats.served += 1
            self.stats.bytes_sent += sent
            self.stats.seconds_sent += time.monotonic() - t0
        except (OSError, EOFError, asyncio.IncompleteReadError, TimeoutError, ValueError,
                KVTransferError) as e:
            if hold is not None:
                self.stats.failed += 1
            log.warning("KV transfer %s: the pull failed: %s: %s", tid, type(e).__name__, e)
        finally:
            if hold is not None:        # pulled or not, a handle is used once
                self.engine.release_kv(tid)
            self._conns.discard(writer)
            writer.close()

    def _check_pull(self, msg: dict) -> tuple[str, str] | None:
        if msg.get("op") != "pull" or msg.get("version") != PROTOCOL_VERSION:
            return "kv_protocol_error", f"expected a version {PROTOCOL_VERSION} pull request"
        if not isinstance(msg.get("transfer_id"), str):
            return "kv_protocol_error", "transfer_id must be a string"
        if msg.get("engine_id") != self.engine_id:
            return "kv_transfer_not_found", (
                f"the KV server at {self.host}:{self.port} is engine "
                f"{self.engine_id}, not {msg.get('engine_id')} (restarted?)")
        hold = self._holds.get(msg.get("transfer_id"))
        if hold is None:
            return "kv_transfer_not_found", (
                f"no KV is held for transfer {msg.get('transfer_id')!r}: "
                f"unknown, already pulled, or expired after {self.timeout:g}s")
        theirs = msg.get("layout") or {}
        diff = [f"{k} {v} here, {theirs.get(k)} there" for k, v in self.layout.items()
                if theirs.get(k) != v]
        if diff:
            return "kv_layout_mismatch", "the engines' KV caches differ: " + "; ".join(diff)
        if (msg.get("num_tokens") != hold.seq.num_prompt_tokens
                or msg.get("prompt_hash") != hold.prompt_hash):
            return "kv_prompt_mismatch", (
                f"the prompt differs from leg 1's ({msg.get('num_tokens')} tokens "
                f"vs {hold.seq.num_prompt_tokens}): leg 2 must send leg 1's prompt")
        first = msg.get("first_block")
        if not isinstance(first, int) or not 0 <= first < hold.num_blocks:
            return "kv_protocol_error", (f"first_block must be in [0, {hold.num_blocks}), "
                                         f"got {first!r}")
        return None

    async def _send_blocks(self, writer: asyncio.StreamWriter, hold: _Hold, first: int) -> int:
        """The header, then one D frame per layer; the bytes sent. (Held blocks are never written
        by a step, so they are read here, off the engine thread, while it runs.)"""
        runner = self.core.runner
        blocks = hold.seq.block_table[first:hold.num_blocks]
        layer_bytes = 2 * len(blocks) * self.block_bytes
        _write_json(writer, {"ok": True, "num_blocks": len(blocks), "layer_bytes": layer_bytes})
        idx = torch.tensor(blocks, device=runner.device)
        sent = 0
        for layer in range(len(runner.kv_caches)):
            data = await asyncio.to_thread(_gather, runner.kv_caches[layer], idx)
            writer.write(FRAME.pack(b"D", data.nbytes))
            writer.write(memoryview(data))
            await writer.drain()
            sent += data.nbytes
        return sent

    # --- decode side: the pull -------------------------------------------------------------

    async def pull(self, remote: RemotePrefill, ids: list[int], params: SamplingParams,
                   request_id: str | None = None,
                   cache_salt: str | None = None) -> tuple[RequestStream, float]:
        """Pull a prompt's KV from a prefill engine into blocks of this engine; the sequence's
        stream (scheduled as a decode) and the seconds the pull took. Raises HTTPError (nothing
        has been sent to the client yet); on any failure the blocks taken are freed. The
        request's `cache_salt` keys the pulled blocks in this engine's prefix cache."""
        if remote.num_tokens is not None and remote.num_tokens != len(ids):
            raise HTTPError(400, f"'kv_transfer_params.num_tokens' is {remote.num_tokens} but the "
                            f"prompt has {len(ids)} tokens: leg 2 must send leg 1's prompt",
                            code="kv_prompt_mismatch")
        seq = Sequence(ids, params, request_id or self.engine.new_request_id(),
                       cache_salt=cache_salt)
        t0 = time.monotonic()
        try:
            if not await self.engine.call(_reserve, self.core.block_manager, seq):
                raise HTTPError(503,
                                f"no free KV blocks for the {len(ids)}-token transferred prompt",
                                code="kv_cache_full")
            first = seq.num_cached_tokens // self.core.args.block_size
            staged = await asyncio.wait_for(self._fetch(remote, seq, first), self.timeout)
        except BaseException as e:
            # on the engine thread after _reserve (one worker, FIFO), even if we were cancelled
            self.engine.call_soon(self.core.block_manager.free, seq)
            if isinstance(e, HTTPError):
                raise
            self.stats.failed += 1
            if isinstance(e, KVTransferError):
                raise e.http() from None
            if isinstance(e, TimeoutError):
                raise KVTransferError(
                    "kv_transfer_failed",
                    f"the pull from {remote.host}:{remote.port} took over {self.timeout:g}s",
                ).http() from None
            if isinstance(e, (OSError, EOFError, asyncio.IncompleteReadError, ValueError)):
                raise KVTransferError(
                    "kv_transfer_failed",
                    f"the prefill engine's KV server at {remote.host}:{remote.port} failed: "
                    f"{type(e).__name__}: {e}",
                ).http() from None
            raise
        elapsed = time.monotonic() - t0
        self.stats.pulled += 1
        self.stats.bytes_received += staged.nbytes
        self.stats.seconds_pulled += elapsed
        # not computed here (vLLM counts external KV as cached)
        seq.num_cached_tokens = len(ids) - 1
        fill = _filler(self.core.runner, seq, first, staged)
        return self.engine.generate_prefilled(seq, fill), elapsed

    async def _fetch(self, remote: RemotePrefill, seq: Sequence, first: int) -> torch.Tensor:
        """[layers, layer_bytes] uint8 on the CPU: blocks [first:] of the prompt, K then V."""
        reader, writer = await asyncio.open_connection(remote.host, remote.port, limit=READ_LIMIT)
        try:
            _write_json(writer, {"op": "pull", "version": PROTOCOL_VERSION,
                                 "transfer_id": remote.transfer_id,
                                 "engine_id": remote.engine_id, "first_block": first,
                                 "num_tokens": len(seq),
                                 "prompt_hash": prompt_hash(seq.token_ids), "layout": self.layout})
            await writer.drain()
            head = await _read_json(reader)
            if not head.get("ok"):
                status = 400 if head.get("code") == "kv_prompt_mismatch" else 502
                raise KVTransferError(str(head.get("code")), str(head.get("message")), status)
            num_blocks = len(seq.block_table) - first
            layer_bytes = 2 * num_blocks * self.block_bytes
            if head.get("num_blocks") != num_blocks or head.get("layer_bytes") != layer_bytes:
                raise KVTransferError("kv_protocol_error",
                                      f"expected {num_blocks} blocks of {layer_bytes} bytes "
                                      f"a layer, the prefill engine offers "
                                      f"{head.get('num_blocks')} / {head.get('layer_bytes')}")
            staged = torch.empty((self.layout["num_layers"], layer_bytes), dtype=torch.uint8)
            rows = staged.numpy()
            for layer in range(len(rows)):
                kind, n = await _read_frame(reader)
                if kind != b"D" or n != layer_bytes:
                    raise KVTransferError("kv_protocol_error",
                                          f"layer {layer}: expected a data frame of "
                                          f"{layer_bytes} bytes, got {kind!r} of {n}")
                await _read_into(reader, rows[layer])
            _write_json(writer, {"op": "done"})
            await writer.drain()
            return staged
        finally:
            writer.close()


def _gather(kv_cache: tuple[torch.Tensor, torch.Tensor], idx: torch.Tensor):
    """One layer's K rows then V rows of the blocks `idx`, as a flat uint8 numpy array. It runs
    off the engine thread, so a CPU cache is read by numpy, whose copies start no OpenMP team:
    torch's indexing there would, and the engine's every step after it waits for wake-ups
    (backend/async_engine.py; two cores, SmolLM2: decode steps 13.2-14.0 -> 24.6 ms after one
    gather of 200 blocks)."""
    k, v = kv_cache
    if k.device.type != "cpu":
        rows = torch.cat((k.view(torch.uint8)[idx], v.view(torch.uint8)[idx]))
        return rows.cpu().reshape(-1).numpy()
    blocks = idx.numpy()
    k8, v8 = k.view(torch.uint8).numpy(), v.view(torch.uint8).numpy()
    rows = np.empty((2, len(blocks), *k8.shape[1:]), dtype=np.uint8)
    np.take(k8, blocks, axis=0, out=rows[0])
    np.take(v8, blocks, axis=0, out=rows[1])
    return rows.reshape(-1)


async def _read_into(reader: asyncio.StreamReader, out) -> None:
    """Fill the uint8 numpy array `out` from the stream."""
    view, at = memoryview(out), 0
    while at < len(view):
        chunk = await reader.read(len(view) - at)
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(view[:at]), len(view))
        view[at:at + len(chunk)] = chunk
        at += len(chunk)


def _reserve(bm, seq: Sequence) -> bool:
    """On the engine thread: blocks for the whole prompt, starting from this engine's own cached
    prefix, in its KV cache or second tier (those need no pull)."""
    return bm.allocate(seq, len(seq), bm.match_prefix(seq))


def _filler(runner, seq: Sequence, first: int, staged: torch.Tensor):
    """The write of pulled KV into `seq`'s blocks [first:], for the engine thread to run."""
    def fill() -> None:
        idx = torch.tensor(seq.block_table[first:], device=runner.device)
        data = staged.to(runner.device)
        for (k, v), rows in zip(runner.kv_caches, data, strict=True):
            k8, v8 = k.view(torch.uint8), v.view(torch.uint8)
            rows = rows.view(2, len(idx), *k8.shape[1:])
            k8[idx] = rows[0]
            v8[idx] = rows[1]
    return fill
