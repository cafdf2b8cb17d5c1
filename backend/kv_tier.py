"""The second KV tier: blocks evicted from the device KV cache are kept here, so a prompt whose
prefix was evicted loads it back instead of recomputing it (vLLM's KV offloading,
`--kv-offloading-size GiB`).

Storage: a pool of slots, each one block's KV for every layer, K and V, as raw bytes of the
cache dtype (FP8 stays FP8). On CUDA the pool is pinned host memory. On CPU, where the device
cache already is host memory, it is a memory-mapped file in `--kv-offloading-path` (default: the
system's temporary directory), so it can be as large as the disk; the file is reserved in full
at start (a full disk fails the start, not a write in the middle of serving) and unlinked as
soon as it is mapped, so it never outlives the process, even a killed one.

Index: the device prefix cache's chained block hash -> slot, least recently used first. An
entry keeps its block's parent hash and token ids (a hit compares them, as the device cache
does, so a hash collision is never served) and an xxh64 of the slot's bytes taken when it was
stored. A load checks that checksum: a block whose bytes changed is dropped and recomputed.

When: the block manager offers the tier every hashed block whose last reference goes (it stays
in the device cache's free queue, hit-able, until it is reused), and a cache_control-pinned
block again just before it is dropped for room (backend/cache_pins.py): a copy the tier made at
its release may have been evicted meanwhile, and one it still holds becomes its most recent.
Keys carry cache_salt: a salted prompt's first block chains from the salt, and `holds` compares
the parent hash, so a block is never served across salts. A block the tier does not hold
yet is copied out by one worker thread, off the step's critical path: a hashed block is never
written, so it can be read while it waits in the free queue. Before the free queue hands such a
block out for new KV, `wait_store` waits for its copy. Loads run on the engine thread when a
sequence is admitted (`BlockManager.allocate`), into fresh blocks.

CUDA: all copies run on one side stream. A store first waits for an event recorded on the
compute stream when its blocks were freed (their KV is written by then); a load waits for the
compute stream, and the compute stream then waits for the loads, so the next forward reads them.
Stores and loads share the stream, so a slot is never overwritten before a queued load from it
has run.

KV events (backend/kv_events.py): with a sink in `events`, a block is recorded as stored on the
"CPU" medium when its copy is queued (from then on `holds` is true and a load waits for the
copy), and as removed when its entry is evicted for room or dropped by a failed check.
"""
from __future__ import annotations

import errno
import logging
import math
import os
import tempfile
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xxhash

from prefixgate.backend.kv_events import MEDIUM_CPU, KVEventSink

log = logging.getLogger("prefixgate.engine")

GIB = 1 << 30
FILE_PREFIX = "prefixgate-kv-tier-"

BlockKey = tuple[int, int, tuple[int, ...]]     # block hash, parent hash, token ids


@dataclass(slots=True)
class _Entry:
    slot: int
    parent_hash: int
    token_ids: tuple[int, ...]
    stored: Future | None = None      # the copy into the slot
    checksum: int | None = None       # xxh64 of the slot, set once the copy is done (None: failed)


@dataclass
class KVTierStats:
    stored_blocks: int = 0
    loaded_blocks: int = 0
    hit_tokens: int = 0
    corrupted_blocks: int = 0         # loads refused: the slot's bytes no longer match


class KVTier:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 size_gib: float, path: str | None = None):
        # uint8 views: bytes move as they are, whatever the cache dtype (FP8 included)
        self.kv_caches = [(k.view(torch.uint8), v.view(torch.uint8)) for k, v in kv_caches]
        self.device = kv_caches[0][0].device
        self.block_size = block_size
        slot_shape = (len(kv_caches), 2, *self.kv_caches[0][0].shape[1:])  # layers, K/V, a block
        slot_bytes = math.prod(slot_shape)
        self.num_slots = int(size_gib * GIB) // slot_bytes
        if self.num_slots < 1:
            raise ValueError(f"--kv-offloading-size: {size_gib:g} GiB is less than one KV block "
                             f"({slot_bytes} bytes)")
        shape = (self.num_slots, *slot_shape)
        if self.device.type == "cuda":
            self.pool = _pinned(shape, size_gib)
            self.stream = torch.cuda.Stream(self.device)
            where = "pinned host memory"
            if path is not None:
                log.warning("--kv-offloading-path is not used on CUDA: "
                            "the tier is pinned host memory")
        else:
            directory = path or tempfile.gettempdir()
            self.pool = _mapped_file(shape, directory)
            self.stream = None
            where = f"a file in {directory}"
        self.index: OrderedDict[int, _Entry] = OrderedDict()      # block hash -> entry; front: LRU
        self._free_slots = list(range(self.num_slots))[::-1]       # pop() hands out slot 0 first
        self._pending: dict[int, Future] = {}                      # device block id -> its copy out
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="prefixgate-kv-tier")
        self.stats = KVTierStats()
        self.events: KVEventSink | None = None     # where KV events go, when they are published
        log.info("second KV tier: %d blocks (%.3g GiB) in %s", self.num_slots, size_gib, where)

    def usage(self) -> float:
        """Fraction of slots holding a block (0..1)."""
        return len(self.index) / self.num_slots

    def holds(self, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]) -> bool:
        entry = self.index.get(block_hash)
        return (entry is not None and entry.parent_hash == parent_hash
                and entry.token_ids == token_ids)

    # --- stores: engine thread queues, the worker copies ------------------------------------

    def store(self, blocks) -> None:
        """Keep copies of freed, hashed `Block`s (in the order freed: tail first) that the tier
        does not hold yet; those it holds become the most recently used."""
        new = []
        for block in blocks:
            if block.hash in self.index:
                self.index.move_to_end(block.hash)
            else:
                new.append(block)
        # More than fit: keep the last freed, a sequence's head, the part prompts share. With
        # at most num_slots new entries, making room never evicts one of them.
        new = new[-self.num_slots:]
        if not new:
            return
        items = []
        for block in new:
            entry = _Entry(self._take_slot(), block.parent_hash, block.token_ids)
            self.index[block.hash] = entry
            items.append((block.block_id, entry))
        ready = None
        # the blocks' KV is complete once the compute stream gets here
        if self.stream is not None:
            ready = torch.cuda.current_stream(self.device).record_event()
        copy = self._worker.submit(self._copy_out, items, ready)
        for block_id, entry in items:
            entry.stored = copy
            self._pending[block_id] = copy
        if self.events is not None:     # in chain order (they were freed tail first)
            for block in reversed(new):
                self.events.stored(block.hash, block.parent_hash, block.token_ids, MEDIUM_CPU,
                                   block.salt)

    def wait_store(self, block_id: int) -> None:
        """Before a device block gets new KV: wait until its copy into the tier (if any) is done."""
        copy = self._pending.pop(block_id, None)
        if copy is not None:
            copy.result()

    def _take_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        evicted, oldest = self.index.popitem(last=False)
        oldest.stored.result()          # its copy may still be writing the slot
        self._record_removed(evicted)
        return oldest.slot

    def _record_removed(self, block_hash: int) -> None:
        if self.events is not None:
            self.events.removed(block_hash, MEDIUM_CPU)

    def _copy_out(self, items: list[tuple[int, _Entry]], ready) -> None:
        """On the worker: device blocks -> slots, then each slot's checksum."""
        try:
            if self.stream is not None:
                self.stream.wait_event(ready)
            # None (CPU): the current thread, synchronously
            with torch.cuda.stream(self.stream):
                for block_id, entry in items:
                    self._copy(entry.slot, block_id, to_tier=True)
                done = self.stream.record_event() if self.stream is not None else None
            if done is not None:
                done.synchronize()
            for _, entry in items:
                entry.checksum = self._checksum(entry.slot)
            self.stats.stored_blocks += len(items)
        except Exception:   # a failed store only costs a recompute: its entries never load
            log.exception("second KV tier: storing %d blocks failed", len(items))

    # --- loads: engine thread ----------------------------------------------------------------

    def load(self, keys: list[BlockKey], block_ids: list[int]) -> int:
        """Copy the blocks `keys` name into the device blocks `block_ids`, in order, stopping at
        the first one the tier no longer holds or whose checksum fails; how many were loaded."""
        if self.stream is not None:     # the fresh blocks may still be read by queued compute work
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        loaded = 0
        with torch.cuda.stream(self.stream):
            for (block_hash, parent_hash, token_ids), block_id in zip(keys, block_ids):
                slot = self._verified_slot(block_hash, parent_hash, token_ids)
                if slot is None:
                    break
                self._copy(slot, block_id, to_tier=False)
                self.index.move_to_end(block_hash)
                loaded += 1
        if loaded and self.stream is not None:   # the next forward reads what was loaded
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.stats.loaded_blocks += loaded
        self.stats.hit_tokens += loaded * self.block_size
        return loaded

    def _verified_slot(self, block_hash: int, parent_hash: int,
                       token_ids: tuple[int, ...]) -> int | None:
        """The slot holding this block, its bytes checked; a corrupted entry is dropped."""
        if not self.holds(block_hash, parent_hash, token_ids):
            return None
        entry = self.index[block_hash]
        entry.stored.result()           # done long ago, normally
        if entry.checksum is not None and self._checksum(entry.slot) == entry.checksum:
            return entry.slot
        if entry.checksum is not None:
            self.stats.corrupted_blocks += 1
            log.warning("second KV tier: block %016x failed its checksum; recomputing it",
                        block_hash)
        del self.index[block_hash]
        self._free_slots.append(entry.slot)
        self._record_removed(block_hash)
        return None

    # --- bytes -------------------------------------------------------------------------------

    def _copy(self, slot: int, block_id: int, to_tier: bool) -> None:
        """One block, every layer, K and V, between the device cache and a slot."""
        for layer, kv in enumerate(self.kv_caches):
            for i, cache in enumerate(kv):
                if to_tier:
                    self.pool[slot, layer, i].copy_(cache[block_id], non_blocking=True)
                else:
                    cache[block_id].copy_(self.pool[slot, layer, i], non_blocking=True)

    def _checksum(self, slot: int) -> int:
        return xxhash.xxh64_intdigest(self.pool[slot].numpy())

    def close(self) -> None:
        """Wait for queued stores and let the pool go (its file is already unlinked)."""
        self._worker.shutdown(wait=True)
        self.index.clear()
        self._pending.clear()
        self.pool = None


def _pinned(shape: tuple[int, ...], size_gib: float) -> torch.Tensor:
    try:
        return torch.empty(shape, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as e:
        raise ValueError(f"--kv-offloading-size: cannot pin {size_gib:g} GiB of host memory: "
                         f"{e}") from None


def _mapped_file(shape: tuple[int, ...], directory: str) -> torch.Tensor:
    """A fresh file in `directory` sized for the pool, mapped shared, then unlinked (the mapping
    keeps its space until the process ends)."""
    size = math.prod(shape)
    try:
        fd, name = tempfile.mkstemp(prefix=FILE_PREFIX, suffix=".bin", dir=directory)
    except OSError as e:
        raise ValueError(f"--kv-offloading-path: {directory}: not writable "
                         f"({e.strerror})") from None
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise ValueError(f"--kv-offloading-path: {directory}: no room for {size} bytes "
                                 f"(--kv-offloading-size)") from None
            os.ftruncate(fd, size)      # a file system without fallocate: a sparse file
        return torch.from_file(name, shared=True, size=size, dtype=torch.uint8).view(shape)
    finally:
        os.close(fd)
        os.unlink(name)
