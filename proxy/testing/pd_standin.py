"""Stand-ins for prefill/decode (P/D) instances of vLLM and SGLang, for the gateway's P/D tests.

Each is the ordinary stand-in (proxy/testing/standin.py: streams, records, can be made to
fail through its Behaviour) with the P/D side of the real server in front of its completions.

vLLM, KV-connector flow (vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py):
- `VllmPrefill` (kv_producer): a request whose `kv_transfer_params` asks `do_remote_decode`
  is computed and, when it ended capped at its length (`max_tokens: 1`, not streamed: the
  connector only hands off FINISHED_LENGTH_CAPPED requests), its blocks are held in a
  `KVStore` and the JSON answer carries a top-level `kv_transfer_params`
  {do_remote_prefill: true, do_remote_decode: false, remote_engine_id, remote_block_ids,
  remote_request_id, remote_host, remote_port, tp_size}, as NixlConnectorScheduler's
  request_finished returns. The request id is vLLM's: from the X-Request-Id header.
  `give_params = False` makes it answer without them (a vLLM started without a connector).
- `VllmDecode` (kv_consumer): a request with `kv_transfer_params.do_remote_prefill` must name
  the engine, blocks, request id, host and port, and pulls those blocks from the KVStore (a
  pull consumes them, as NIXL's does: the prefill frees them once read); anything missing or
  already pulled is a 500. Without `kv_transfer_params` it computes the prompt itself, as
  vLLM does. `pulled` records what it pulled.

SGLang, bootstrap handshake (python/sglang/srt/disaggregation/: mini_lb.py sends both legs
the same body plus bootstrap_host/port/room; the decode's KV receiver meets the prefill's
sender in the room through the prefill's bootstrap server):
- both refuse (400) a request without `bootstrap_host`, `bootstrap_port` and an integer
  `bootstrap_room` ("bootstrap_room should not be None");
- `SglangPrefill` checks that the host and port are its own (its `bootstrap_port`: None means
  SGLang's default 8998), waits for the decode to join the room (within `wait_s`, else 500,
  like SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT), sends the KV, and answers (1 token);
- `SglangDecode` joins the room and waits for the prefill's KV (within `wait_s`, else 500,
  like SGLANG_DISAGGREGATION_WAITING_TIMEOUT), then decodes its answer. A decode whose
  request is cancelled while it waits counts it in `cancelled`.
Prefill and decode stand-ins of one test share a `Bootstrap` (the rooms) and a `KVStore`.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from prefixgate.proxy.testing.standin import StandIn
from prefixgate.proxy.testing.surface import vllm_error

SGLANG_BOOTSTRAP_PORT = 8998          # SGLang's --disaggregation-bootstrap-port default
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


# --- vLLM ------------------------------------------------------------------------------------

@dataclass
class KVStore:
    """Blocks that prefill engines hold for a remote decode: (engine id, request id) -> ids."""
    held: dict = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def hold(self, engine_id: str, request_id: str, blocks: int) -> list[int]:
        ids = [next(self._ids) for _ in range(blocks)]
        self.held[(engine_id, request_id)] = ids
        return ids

    def pull(self, params: dict) -> str | None:
        """Read (and free) the blocks `params` names; why not, when they cannot be read."""
        missing = [k for k in ("remote_engine_id", "remote_block_ids", "remote_request_id",
                               "remote_host", "remote_port") if params.get(k) is None]
        if missing:
            return f"kv_transfer_params without {', '.join(missing)}"
        key = (params["remote_engine_id"], params["remote_request_id"])
        if self.held.get(key) != params["remote_block_ids"]:
            return f"no blocks {params['remote_block_ids']} held for {key} (pulled already?)"
        del self.held[key]
        return None


@dataclass
class VllmPrefill(StandIn):
    kv: KVStore = field(default_factory=KVStore)
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    side_channel_port: int = 5600      # VLLM_NIXL_SIDE_CHANNEL_PORT
    give_params: bool = True

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        asked = body.get("kv_transfer_params")
        resp = await super().completion(request)
        if not (isinstance(asked, dict) and asked.get("do_remote_decode")) or not self.give_params:
            return resp
        capped = body.get("max_tokens") == 1 and not body.get("stream")
        if resp.status != 200 or not capped:
            return resp
        answer = json.loads(resp.body)
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        answer["kv_transfer_params"] = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": self.kv.hold(self.engine_id, request_id, blocks=3),
            "remote_request_id": request_id, "remote_host": "127.0.0.1",
            "remote_port": self.side_channel_port, "tp_size": 1}
        return web.json_response(answer)


@dataclass
class VllmDecode(StandIn):
    kv: KVStore = field(default_factory=KVStore)
    pulled: list = field(default_factory=list)      # the kv_transfer_params it pulled with

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        params = body.get("kv_transfer_params")
        if isinstance(params, dict) and params.get("do_remote_prefill"):
            problem = self.kv.pull(params)
            if problem is not None:
                return _refuse(self, request, body, f"KV transfer failed: {problem}")
            self.pulled.append(params)
        return await super().completion(request)


# --- SGLang ----------------------------------------------------------------------------------

@dataclass
class Room:
    prefill: asyncio.Event = field(default_factory=asyncio.Event)    # the prefill arrived
    decode: asyncio.Event = field(default_factory=asyncio.Event)     # the decode joined
    sent: asyncio.Event = field(default_factory=asyncio.Event)       # the KV went across
    host: str | None = None             # the prefill's bootstrap address
    port: int | None = None
    arrived: dict = field(default_factory=dict)      # "prefill"/"decode" -> monotonic time


@dataclass
class Bootstrap:
    rooms: dict = field(default_factory=dict)        # bootstrap_room -> Room

    def room(self, number: int) -> Room:
        return self.rooms.setdefault(number, Room())


def _refuse(standin: StandIn, request: web.Request, body: dict, message: str,
            status: int = 500) -> web.Response:
    """Record the request and answer it with vLLM's (and SGLang's) error shape."""
    standin._record(request, body, standin._behaviour(body))
    return vllm_error(message, status, "BadRequestError" if status == 400 else
                      "InternalServerError")


async def _within(event: asyncio.Event, seconds: float) -> bool:
    """Wait for `event`; False when `seconds` pass first."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True


def _bootstrap_problem(body: dict) -> str | None:
    missing = [k for k in BOOTSTRAP_FIELDS if k not in body]
    if missing:
        return f"missing {', '.join(missing)}"
    if not isinstance(body["bootstrap_room"], int) or isinstance(body["bootstrap_room"], bool):
        return "bootstrap_room should not be None (an integer)"
    return None


@dataclass
class SglangPrefill(StandIn):
    bootstrap: Bootstrap = field(default_factory=Bootstrap)
    bootstrap_port: int | None = None      # its --disaggregation-bootstrap-port (None: 8998)
    host: str = "127.0.0.1"
    wait_s: float = 5.0                    # SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        problem = _bootstrap_problem(body)
        port = self.bootstrap_port or SGLANG_BOOTSTRAP_PORT
        if problem is None and (body["bootstrap_host"], body["bootstrap_port"] or
                                SGLANG_BOOTSTRAP_PORT) != (self.host, port):
            problem = (f"bootstrap address {body['bootstrap_host']}:{body['bootstrap_port']} "
                       f"is not this prefill's ({self.host}:{port})")
        if problem is not None:
            return _refuse(self, request, body, problem, 400)
        if self._behaviour(body).fail:        # fails before it takes part in the handshake
            return await super().completion(request)
        room = self.bootstrap.room(body["bootstrap_room"])
        room.host, room.port, room.arrived["prefill"] = self.host, port, time.monotonic()
        room.prefill.set()
        if not await _within(room.decode, self.wait_s):
            return _refuse(self, request, body, "bootstrap timeout: no decode joined the room")
        room.sent.set()
        return await super().completion(request)


@dataclass
class SglangDecode(StandIn):
    bootstrap: Bootstrap = field(default_factory=Bootstrap)
    wait_s: float = 5.0                    # SGLANG_DISAGGREGATION_WAITING_TIMEOUT
    cancelled: int = 0                     # requests cancelled while waiting for the KV
    received: int = 0                      # requests whose KV arrived

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not any(k in body for k in BOOTSTRAP_FIELDS):
            return await super().completion(request)       # a plain request: computed here
        problem = _bootstrap_problem(body)
        if problem is not None:
            return _refuse(self, request, body, problem, 400)
        room = self.bootstrap.room(body["bootstrap_room"])
        room.arrived["decode"] = time.monotonic()
        room.decode.set()
        try:
            arrived = await _within(room.sent, self.wait_s)
        except asyncio.CancelledError:
            self._record(request, body, self._behaviour(body), cancelled=True)
            self.cancelled += 1
            raise
        if not arrived:
            return _refuse(self, request, body, "KV transfer timed out waiting for the prefill")
        if (room.host, room.port) != (body["bootstrap_host"],
                                      body["bootstrap_port"] or SGLANG_BOOTSTRAP_PORT):
            return _refuse(self, request, body, "the room's prefill is at another address")
        self.received += 1
        return await super().completion(request)
