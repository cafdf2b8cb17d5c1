"""A prefill's arithmetic, counted, so a prefix-cache hit's speed-up can be read against the
most it could be: cold FLOPs / warm FLOPs for the same prompt.

For `new` tokens computed after `cached` tokens already in the KV cache:
    matrices   2 · layer_params · new  +  2 · vocab · hidden    (logits for the last token only)
    attention  4 · head_dim · heads · layers · pairs,  pairs = new · cached + new · (new + 1) / 2
(causal: token i attends to the i keys up to itself, a query-key product and a value sum of
head_dim multiply-adds each, per query head and layer). Embedding lookups, norms, rotary and
softmax are left out: they are not matrix products and are a small share.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillFlops:
    layer_params: int      # every decoder layer's weights: multiplied once per token
    head_params: int       # the output projection (vocab x hidden): once, for the last token
    layers: int
    heads: int
    head_dim: int

    @classmethod
    def of(cls, config) -> PrefillFlops:
        """From a model's LlamaConfig: its layers' weights as the loader expects them in a
        checkpoint (loader.expected_shapes), not a loaded model's parameters(), which do not
        see the linears the engine prepacks for oneDNN (backend/cpu_linear.py)."""
        from prefixgate.backend.loader import expected_shapes

        layer_params = sum(math.prod(shape) for name, shape in expected_shapes(config).items()
                           if name.startswith("model.layers."))
        return cls(layer_params=layer_params, head_params=config.vocab_size * config.hidden_size,
                   layers=config.num_hidden_layers, heads=config.num_attention_heads,
                   head_dim=config.head_dim)

    def __call__(self, new: int, cached: int = 0) -> float:
        pairs = new * cached + new * (new + 1) // 2
        return (2 * self.layer_params * new + 2 * self.head_params
                + 4 * self.head_dim * self.heads * self.layers * pairs)

    def hit_limit(self, tokens: int, cached: int) -> float:
        """The speed-up of a hit on `cached` of `tokens` if time followed FLOPs."""
        return self(tokens) / self(tokens - cached, cached)
