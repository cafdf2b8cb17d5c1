"""A decode step's decoder layers in one compiled call on a CPU (cpu_decode_layers.cpp).

Through the modules, each of a layer's ~15 operators is reached from Python (a module call,
the checks of which kernel takes it, views): ~150 us per layer, 4-5 ms of a batch-1 decode step
of SmolLM2 that the weights' one read from memory would bound at ~18 ms. DecodeLayers runs the
same kernels (cpu_ops.cpp's), in the same order, layer after layer from C++: the logits are
bit for bit those of the modules, and that step took 27.5 -> 22.4 ms on one core of the Xeon
with AMX (docs/engine.md). vLLM and SGLang cut the same overhead with torch.compile and CPU
graphs; here, where every step is already a compiled kernel, a loop in C++ is what remains.

It takes a step only where every operator of the layer would have gone to the same kernels
through the modules: a pure decode step over a cache of the activations' dtype, nothing turned
off by cpu_ops.plain(), of the rows the few-rows products take (fp32: 1-56) or, where every
product keeps its packed weight too (bf16), of any batch: past the few-rows kernel's 6 rows
the products are oneDNN's on the packed weights, as in the modules. Anything else (prefill and
mixed steps, FP8 caches, GPUs) runs the modules.
"""
from __future__ import annotations

import torch

from prefixgate.backend import cpu_ops
from prefixgate.backend.attention import AttentionMetadata

# the operators a layer's step runs; turning any off (cpu_ops.plain) turns this off
PARTS_USED = ("elementwise", "decode_attention", "write_kv", "few_rows", "decode_layers")
# no bound on a batch's rows where every product has its packed weight too (bf16)
_ANY_BATCH = 1 << 31


class DecodeLayers:
    """The model's layers (a LlamaModel's, prepared by cpu_linear) as one compiled loop."""

    def __init__(self, model: torch.nn.Module):
        layers = model.layers
        attn = layers[0].self_attn
        self.dtype = model.embed_tokens.weight.dtype
        products = [m for layer in layers for m in _products(layer)]
        few_rows = cpu_ops.few_rows_of(self.dtype)
        # past the few-rows kernel's rows the modules use the packed weights: so does the loop
        packed = [getattr(m, "packed", None) for m in products]
        self.rows = (range(1, _ANY_BATCH) if all(p is not None for p in packed) else few_rows)
        self._layers = cpu_ops.decode_layers(
            [layer.input_layernorm.weight for layer in layers],
            [layer.post_attention_layernorm.weight for layer in layers],
            [_plain_weight(m) for m in products], packed, [m.bias for m in products],
            attn.num_heads, attn.num_kv_heads, attn.head_dim, few_rows[-1],
            layers[0].input_layernorm.eps, attn.scale)

    def takes(self, x: torch.Tensor, meta: AttentionMetadata, kv_caches) -> bool:
        """Whether this step goes through the compiled loop (see the module's docstring)."""
        return (meta.is_decode and meta.kv_mantissa_bits is None
                and meta.attention_backend in (None, "auto")
                and x.dtype == self.dtype and kv_caches[0][0].dtype == self.dtype
                and all(cpu_ops.uses_fused(x, part) for part in PARTS_USED)
                and x.shape[0] in self.rows)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 meta: AttentionMetadata, kv_caches) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer on x (the step's embeddings): the last one's output and the residual
        stream, as the modules' loop returns them."""
        return self._layers.forward(
            x, cos, sin, [k for k, _ in kv_caches], [v for _, v in kv_caches],
            meta.slot_mapping, meta.block_tables.int().contiguous(),
            meta.seq_lens.int().contiguous())


def _products(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """A decoder layer's projections in the loop's order: q/k/v, output, gate/up, down."""
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)


def _plain_weight(layer: torch.nn.Module) -> torch.Tensor | None:
    """The row-major weight a few-rows product reads: cpu_linear's layers expose it as
    `few_rows_weight` (None where they keep none); any other layer has none."""
    return getattr(layer, "few_rows_weight", None)


def attach(model: torch.nn.Module) -> bool:
    """Give a LlamaForCausalLM prepared for a CPU (cpu_linear.prepare_for_inference) its
    compiled decode loop, where every product keeps a plain weight the few-rows kernels take
    (fp32, or bf16 on AVX-512 with the copies in memory) and decode attention reads its heads;
    returns whether it did."""
    inner = model.model
    dtype = inner.embed_tokens.weight.dtype
    weights = [_plain_weight(m) for layer in inner.layers for m in _products(layer)]
    if (not cpu_ops.available() or not cpu_ops.few_rows_of(dtype)
            or not cpu_ops.fits_heads(inner.layers[0].self_attn.head_dim)
            or any(w is None or w.dtype != dtype or not cpu_ops.multiplies_weight(w)
                   for w in weights)):
        return False
    inner.decode_layers = DecodeLayers(inner)
    return True
