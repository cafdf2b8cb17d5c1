"""The exact prefix index: what each engine says its KV cache holds, from its KV events.

Engines (vLLM with `--kv-events-config`, the bundled engine) publish `BlockStored` /
`BlockRemoved` / `AllBlocksCleared` events (`decode_batch` reads vLLM's msgpack layouts:
the array-like one, `[ts, events, data_parallel_rank]` with each event `[tag, fields...]`,
and the map one of newer vLLM, `{"ts", "events", ...}` with each event `{"type": tag, ...}`).

An engine's block hashes depend on its hash function and seed (vLLM: sha256 or a seeded
hash; ours: xxh64), so they cannot be compared with the gateway's keys. Instead each stored
block is keyed by its event's `token_ids` run through the gateway's own chain
(`common.block_hash.block_hash_chain`, continued from the parent block's key): the same key
`prefix_route` computes for a prompt with those tokens. An engine block may hold several of
the gateway's: its block size must be a multiple of `block_tokens` (vLLM's CPU backend caches
128-token blocks, its GPU backends 16; the bundled engine 16), and each engine block stands
for that many keys. Two engine blocks that share only a leading part (prompts that part
mid-block) share those keys: each key keeps the engine blocks holding it, and goes when the
last of them does. Ignored and counted: a block size that is no
multiple; a run whose parent was never seen (its `BlockStored` comes first, or it is the
root); blocks whose hash took more than their tokens (an adapter: `lora_id`/`lora_name`;
`extra_keys` of images or prompt embeddings), whose KV the same tokens would not reproduce;
groups that are not full attention (`kv_cache_spec_kind`: a sliding window keeps no whole
prefix). A salted prompt's blocks are indexed: vLLM folds `cache_salt` into the first block's
hash only and publishes it as that block's `extra_keys` entry `[salt]` (its untagged
`(cache_salt,)`; later blocks: None), so a run from the root with that entry is keyed from
`salted_root(salt)` — the chain prefix_route computes for a request with that salt — and the
blocks after it follow from their parent as any.
The engine's hash of each block is kept only to apply `BlockRemoved`.

Media: a block held on the device ("GPU") and in a second tier ("CPU", vLLM's offloading
medium) counts as held until both have removed it; events without a medium count as GPU.

Memory: at most `capacity` blocks per engine; past that the least recently stored go (the
engine will have evicted them first too, most likely). As in `prefix_index.py`, one dict maps
a key to a bit mask of the engines holding it, so a lookup costs one probe per matched block
whatever the number of engines.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import msgpack

from prefixgate.common.block_hash import block_hash_chain, salted_root

MEDIA = {None: 1, "GPU": 1, "CPU": 2}     # bits of the media a block is held in
OTHER_MEDIUM = 4                          # a medium we do not know (disk, ...): still held
ALL_MEDIA = ~0
FULL_ATTENTION = "full_attention"         # vLLM's kv_cache_spec_kind of a whole-prefix cache


@dataclass(slots=True)
class Stored:
    block_hashes: list
    parent_block_hash: object
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list | None = None
    kv_cache_spec_kind: str | None = None

    def plain(self) -> bool:
        """Whether its blocks' KV follows from their tokens alone, but for a first block's
        cache salt (see the module's doc)."""
        if (self.lora_id is not None or self.lora_name is not None
                or self.kv_cache_spec_kind not in (None, FULL_ATTENTION)):
            return False
        extra = self.extra_keys or ()
        return all(k is None or (i == 0 and self.salt() is not None) for i, k in enumerate(extra))

    def salt(self) -> str | None:
        """The cache salt of a run that starts at the root: its first block's extra keys are
        vLLM's untagged `(cache_salt,)` — one string (with no adapter, a lone string in the
        extra keys can be nothing else: images are (identifier, offset) pairs, prompt
        embeddings bytes)."""
        first = self.extra_keys[0] if self.extra_keys else None
        if (self.parent_block_hash is None and isinstance(first, (list, tuple))
                and len(first) == 1 and isinstance(first[0], str) and first[0]):
            return first[0]
        return None


@dataclass(slots=True)
class Removed:
    block_hashes: list
    medium: str | None


class Cleared:
    __slots__ = ()


class EventFormatError(ValueError):
    """A payload that is not a KVEventBatch in either of vLLM's layouts."""


def decode_batch(payload: bytes) -> list[Stored | Removed | Cleared]:
    """The events of one msgpack KVEventBatch (unknown event types are skipped)."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise EventFormatError(f"not msgpack: {e}") from None
    if isinstance(batch, (list, tuple)) and len(batch) >= 2:
        events = batch[1]
    elif isinstance(batch, dict) and "events" in batch:
        events = batch["events"]
    else:
        raise EventFormatError("not a KVEventBatch: expected [ts, events, ...] or {ts, events}")
    if not isinstance(events, list):
        raise EventFormatError("a KVEventBatch's events must be a list")
    return [e for e in map(_event, events) if e is not None]


def _event(raw) -> Stored | Removed | Cleared | None:
    if isinstance(raw, dict):
        tag, get = raw.get("type"), raw.get
    elif isinstance(raw, (list, tuple)) and raw:
        tag, fields = raw[0], raw[1:]
        names = _FIELDS.get(tag, ())
        get = dict(zip(names, fields)).get
    else:
        raise EventFormatError(f"not a KV event: {raw!r:.80}")
    if tag == "BlockStored":
        return Stored(list(get("block_hashes") or ()), get("parent_block_hash"),
                      list(get("token_ids") or ()), int(get("block_size") or 0),
                      get("lora_id"), get("medium"), get("lora_name"), get("extra_keys"),
                      get("kv_cache_spec_kind"))
    if tag == "BlockRemoved":
        return Removed(list(get("block_hashes") or ()), get("medium"))
    if tag == "AllBlocksCleared":
        return Cleared()
    return None


_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                           "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                           "kv_cache_spec_kind"),
           "BlockRemoved": ("block_hashes", "medium")}


def _bit(medium: str | None) -> int:
    return MEDIA.get(medium, OTHER_MEDIUM)


@dataclass
class EngineBlocks:
    """One engine's blocks: gateway key -> {engine block hash: media bits} of the engine
    blocks holding it, least recently stored first."""
    keys: OrderedDict = field(default_factory=OrderedDict)
    key_of: dict = field(default_factory=dict)          # engine block hash -> its gateway keys
    stored: int = 0                                     # blocks indexed from BlockStored
    ignored: int = 0                                    # blocks of runs that could not be keyed


class KVEventIndex:
    def __init__(self, block_tokens: int, capacity: int):
        self.block_tokens = block_tokens
        self.capacity = capacity
        self.engines: dict[str, EngineBlocks] = {}
        self._holders: dict[int, int] = {}              # gateway key -> bit mask of engines
        self._bit: dict[str, int] = {}
        self._free_bits: list[int] = []

    def size(self, name: str) -> int:
        e = self.engines.get(name)
        return len(e.keys) if e is not None else 0

    def apply(self, name: str, events) -> None:
        """Apply one batch of `name`'s events, in order."""
        engine = self.engines.get(name) or self._add(name)
        for event in events:
            if isinstance(event, Stored):
                self._stored(name, engine, event)
            elif isinstance(event, Removed):
                bit = _bit(event.medium)
                for h in event.block_hashes:
                    self._release(name, engine, h, bit)
            elif isinstance(event, Cleared):
                self.clear(name)
                engine = self.engines[name]
            else:
                raise TypeError(f"not a decoded KV event: {event!r:.80}")

    def clear(self, name: str) -> None:
        """Forget everything `name` holds (AllBlocksCleared, a restarted publisher, a gap that
        replay could not fill); it stays known, empty."""
        engine = self.engines.get(name)
        if engine is None:
            return
        flag = 1 << self._bit[name]
        for key in engine.keys:
            self._unhold(key, flag)
        # the counts go on (they are metrics' counters); only the blocks are forgotten
        self.engines[name] = EngineBlocks(stored=engine.stored, ignored=engine.ignored)

    def remove(self, name: str) -> None:
        """Forget an engine that left (its bit is reused by the next one to join)."""
        if name in self.engines:
            self.clear(name)
            del self.engines[name]
            self._free_bits.append(self._bit.pop(name))

    def retain(self, names) -> None:
        for name in [n for n in self.engines if n not in names]:
            self.remove(name)

    def match(self, chain: list[int]) -> dict[str, int]:
        """Leading blocks of `chain` each engine holds (only engines with at least one)."""
        holders = self._holders
        alive = holders.get(chain[0], 0) if chain else 0
        if not alive:
            return {}
        out: dict[str, int] = {}
        n = 1
        for n in range(1, len(chain) + 1):
            mask = holders.get(chain[n], 0) if n < len(chain) else 0
            ended = alive & ~mask
            if ended:
                for name, bit in self._bit.items():
                    if ended >> bit & 1:
                        out[name] = n
                alive &= mask
                if not alive:
                    break
        return out

    # --- internals ---------------------------------------------------------------------------

    def _add(self, name: str) -> EngineBlocks:
        self._bit[name] = self._free_bits.pop() if self._free_bits else len(self._bit)
        engine = self.engines[name] = EngineBlocks()
        return engine

    def _stored(self, name: str, engine: EngineBlocks, ev: Stored) -> None:
        n = len(ev.block_hashes)
        per_block, rest = divmod(ev.block_size, self.block_tokens)
        parent = (salted_root(ev.salt()) if ev.parent_block_hash is None else
                  engine.key_of.get(ev.parent_block_hash, (None,))[-1])
        if (not ev.plain() or rest or not per_block or parent is None
                or len(ev.token_ids) != n * ev.block_size):
            engine.ignored += n
            return
        bit, flag = _bit(ev.medium), 1 << self._bit[name]
        keys = block_hash_chain(ev.token_ids, self.block_tokens, parent=parent)
        # tail first, so a block is more recent than its parent and capacity takes tails first:
        # what is left of a prefix stays matchable from its head
        for i in reversed(range(n)):
            h, block_keys = ev.block_hashes[i], tuple(keys[i * per_block:(i + 1) * per_block])
            if engine.key_of.get(h, block_keys) != block_keys:   # a hash reused for new tokens
                self._release(name, engine, h, ALL_MEDIA)
            for key in reversed(block_keys):
                self._hold(engine, key, h, bit, flag)
            engine.key_of[h] = block_keys
        engine.stored += n
        while len(engine.keys) > self.capacity:
            oldest = next(iter(engine.keys))
            for h in list(engine.keys[oldest]):     # the rest of their engine blocks go too
                self._release(name, engine, h, ALL_MEDIA)

    def _hold(self, engine: EngineBlocks, key: int, h, bit: int, flag: int) -> None:
        owners = engine.keys.get(key)
        if owners is None:
            engine.keys[key] = {h: bit}
            self._holders[key] = self._holders.get(key, 0) | flag
            return
        owners[h] = owners.get(h, 0) | bit
        engine.keys.move_to_end(key)

    def _release(self, name: str, engine: EngineBlocks, h, bits: int) -> None:
        """Engine block `h` left the media `bits`; its keys go when no block holds them."""
        held = False
        for key in engine.key_of.get(h, ()):
            owners = engine.keys.get(key)
            if owners is None or h not in owners:
                continue
            owners[h] &= ~bits
            if owners[h]:
                held = True
                continue
            del owners[h]
            if not owners:
                del engine.keys[key]
                self._unhold(key, 1 << self._bit[name])
        if not held:
            engine.key_of.pop(h, None)

    def _unhold(self, key: int, flag: int) -> None:
        mask = self._holders.get(key, 0) & ~flag
        if mask:
            self._holders[key] = mask
        else:
            self._holders.pop(key, None)
