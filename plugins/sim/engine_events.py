"""The simulated engines' KV events: the engine's own recording, carried as over ZMQ.

Each simulated engine's `BlockManager` records into a `KVEventSink` (backend/kv_events.py),
as the bundled engine's does with `--kv-events-config`: BlockStored when a block enters the
prefix cache (its hash, its parent's — None for a sequence's first block —, its token ids,
the block size, medium "GPU"; a sequence's consecutive new blocks in one event), BlockRemoved
when a cached block is handed out for new KV. The simulator takes them after each of its
steps, encodes them as the engine's publisher does (vLLM's array-layout KVEventBatch in
msgpack) and decodes them with the gateway's own `decode_batch`, so the exact index reads
the bytes a ZMQ subscriber would: every part of the path but the socket is the real code.
"""
from __future__ import annotations

from prefixgate.backend.block_manager import BlockManager
from prefixgate.backend.kv_events import KVEventSink, encode_batch
from prefixgate.common.block_hash import ROOT_HASH


def record(bm: BlockManager) -> KVEventSink:
    """Make `bm` record its KV events; take them from the returned sink."""
    bm.events = KVEventSink(bm.block_size, ROOT_HASH)
    return bm.events


def encode(events: list, ts: float) -> bytes:
    """One KVEventBatch payload, as `KVEventPublisher` sends it."""
    return encode_batch(events, ts)
