"""One request's state as the scheduler, block manager and model runner see it."""
from __future__ import annotations

import itertools
import time
from enum import Enum

from prefixgate.backend.sampling import SamplingParams
from prefixgate.common.block_hash import salted_root

_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt + generated tokens, the KV blocks that hold them, and timing stamps.

    `num_computed_tokens` counts the tokens whose KV is already in the cache; the next step
    computes `token_ids[num_computed_tokens:]` (or a chunk of them). A decode step has exactly
    one such token: the one sampled last step.
    """

    def __init__(self, token_ids: list[int], params: SamplingParams | None = None,
                 request_id: str | None = None, arrival_time: float | None = None,
                 cache_salt: str | None = None, cache_pins=()):
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else f"seq-{self.seq_id}"
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params or SamplingParams()
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []     # chained hashes of the full blocks so far
        self.num_hashed_blocks = 0            # leading blocks already offered to the prefix cache
        self.num_cached_tokens = 0            # prompt tokens served from the prefix cache
        # vLLM's cache_salt: folded into the first block's parent hash, so only requests with
        # the same salt share cached blocks (backend/block_manager.py)
        self.cache_salt = cache_salt or None
        self.root_hash = salted_root(self.cache_salt)
        # cache_control breakpoints as (prompt tokens, whole blocks; ttl seconds), shortest
        # first: the block manager pins each prefix once it is cached (backend/cache_pins.py)
        self.cache_pins: list[tuple[int, float]] = sorted(cache_pins)
        self.num_pins_applied = 0
        self.generator = None                 # a seeded request's own RNG, on the model's device
        self.kv_hold: str | None = None       # a transfer id: once done, its KV is held for a pull
        self.spec = None                      # speculative decoding's state (spec_decode.py)
        # time.monotonic() stamps, as vLLM's: arrival = reaching the engine (after tokenization)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None      # sampled (the end of the prefill step)
        self.last_token_time: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}, len={len(self)}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def created_cache_tokens(self) -> int | None:
        """Prompt tokens this request computed inside a breakpoint's prefix, i.e. wrote to the
        cache for reuse (Anthropic's cache_creation_input_tokens); None without breakpoints."""
        if not self.cache_pins:
            return None
        marked = min(max(n for n, _ in self.cache_pins), self.num_prompt_tokens)
        return max(0, marked - self.num_cached_tokens)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def drop_last_tokens(self, n: int) -> None:
        """Forget the last `n` output tokens of a finished sequence (a stop string ended it
        before them: they were accepted from a draft in the same step, never generated)."""
        if n:
            del self.token_ids[-n:]
