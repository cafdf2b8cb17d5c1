"""One request's state as the scheduler, block manager and model runner see it."""
from __future__ import annotations

import itertools
import time
from enum import Enum

from prefixgate.backend.sampling import SamplingParams

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
                 request_id: str | None = None, arrival_time: float | None = None):
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
