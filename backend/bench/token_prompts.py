"""The engine benchmarks' prompts: fresh random token ids, so that no two measurements share
a prefix by accident (token ids, so tokenizing is not measured either)."""
from __future__ import annotations

import random


class Prompts:
    """`prompts(n)`: n new random token ids (the same sequence for the same `seed`)."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab = vocab
        self.rng = random.Random(seed)

    def __call__(self, n: int) -> list[int]:
        # Skip the lowest ids, where tokenizers keep their special tokens.
        return [self.rng.randrange(16, self.vocab) for _ in range(n)]
