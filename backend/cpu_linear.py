"""Linear layers for CPU inference: bf16 weights prepacked once for oneDNN, fp32 ones left
plain; a decode step's few rows multiplied by cpu_ops' kernels in both.

A plain `F.linear` hands oneDNN (or MKL) a row-major weight on every call, and the library
re-lays it out into its blocked format each time; for the small matrix products of decoding
that copy costs as much as the product. `torch.ops.mkldnn._reorder_linear_weight` does the
re-layout once at load and `_linear_pointwise` then multiplies against the blocked copy (what
vLLM's CPU path and Inductor's freezing do too). Measured on one core (Xeon with AMX, bf16,
576 x 1,536): 0.16 -> 0.08 ms at one token, 0.12 -> 0.06 ms at eight, 0.66 -> 0.60 ms at 512.

Packing replaces the model's `nn.Linear` modules (their plain weights go) and gives the model a
packed output head (`cpu_head`); a tied head is a packed copy of the embedding, which the lookup
still needs in plain form (the one weight held twice: vocab x hidden, 56 MB for SmolLM2 in bf16).
In fp32 FewRowsLinear takes each layer's weight as it is (packed, oneDNN was slower at one row
and at a prefill's; between, the few-rows kernel beats it up to 56 rows: cpu_ops.FEW_ROWS).

oneDNN's packed bf16 product reads the weight at about half the memory's speed for 1 to 8 rows
(a decode step's batch), where cpu_ops' few-rows kernel reads the plain weight near it up to 2
rows and beats it up to 6. So on AVX-512 a packed layer keeps its plain weight too (SmolLM2:
212 MB more; a tied head's plain weight is the embedding itself) and sends those rows to the
kernel: every product and the head at one row 36 -> 22 ms on one core of the Xeon with AMX
(cpu_ops.FEW_ROWS_BF16). Only where those copies
fit in PLAIN_COPY_SHARE of the machine's memory: a 7B model in bf16 would hold ~13 GB twice.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch
from torch import nn

from prefixgate.backend import cpu_decode_layers, cpu_ops
from prefixgate.backend.loader import cpu_flags

log = logging.getLogger("prefixgate.engine")

# the plain weights kept beside the packed ones for the few-rows kernel take at most this share
# of the memory the engine may use (SmolLM2: 212 MB)
PLAIN_COPY_SHARE = 0.1

# fp32 stays plain: packed, its prefill was slower (5.36 vs 5.15 s for 2,400 tokens of SmolLM2
# on one core) and its one-token product too (0.14 vs 0.12 ms at 576 x 1,536)
PACKABLE = (torch.bfloat16,)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN is in this torch build and multiplies `dtype` natively on this CPU."""
    if device.type != "cpu" or dtype not in PACKABLE or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class FewRowsLinear(nn.Module):
    """An fp32 linear layer whose products of a decode step's few rows go through cpu_ops'
    kernel (MKL's sgemm reads the weight at a third of the memory's speed for 4 to 8 rows), on
    the same weight, not a copy."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = weight
        self.bias = bias

    @property
    def few_rows_weight(self) -> torch.Tensor:
        """The row-major weight the few-rows kernel reads (cpu_decode_layers reads it too)."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_ops.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, few rows"


class PackedLinear(nn.Module):
    """`F.linear(x, weight, bias)` against a weight prepacked for oneDNN; where cpu_ops has the
    bf16 few-rows kernel (AVX-512), a decode step's 1 to 6 rows multiply the plain weight, kept
    beside the packed one (see the module's docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, keep_plain: bool = False):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        plain = weight.detach().contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(plain)
        self.bias = None if bias is None else bias.detach().clone()
        self.weight = plain if keep_plain and cpu_ops.multiplies_bf16_rows() else None

    @property
    def few_rows_weight(self) -> torch.Tensor | None:
        """The plain weight kept for the few-rows kernel, or None (cpu_decode_layers reads it)."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and cpu_ops.takes_few_rows(x, self.weight):
            return cpu_ops.few_rows_linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` (a LlamaForCausalLM) by a PackedLinear and pack its
    output head, where this CPU allows; returns how many layers were packed (0: none could)."""
    embedding = model.model.embed_tokens.weight
    if not can_pack(embedding.dtype, embedding.device):
        return 0
    keep_plain = cpu_ops.multiplies_bf16_rows() and plain_copies_fit(model)
    return _replace_linears(model, functools.partial(PackedLinear, keep_plain=keep_plain))


def plain_copies_fit(model: nn.Module) -> bool:
    """Whether every linear weight kept a second time (a tied head's is the embedding: no copy)
    fits in PLAIN_COPY_SHARE of the memory this process may use; says so in the log if not."""
    extra = sum(m.weight.numel() * m.weight.element_size()
                for m in model.modules() if isinstance(m, nn.Linear))
    memory = usable_memory_bytes()
    if extra <= PLAIN_COPY_SHARE * memory:
        return True
    log.info("bf16 few-rows products off: the plain weights (%.2f GB) would take more than "
             "%.0f%% of memory (%.1f GB); decode steps use the packed ones",
             extra / 1e9, PLAIN_COPY_SHARE * 100, memory / 1e9)
    return False


def usable_memory_bytes() -> int:
    """The machine's physical memory, or a container's cgroup (v2) limit where lower."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return memory
    return min(memory, int(limit)) if limit.isdigit() else memory


def _replace_linears(model: nn.Module, layer) -> int:
    """Every `nn.Linear` of `model` made `layer(weight, bias)`, and a tied head too (as the
    model's cpu_head); returns how many."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, layer(child.weight, child.bias))
                replaced += 1
    if model.lm_head is None:
        model.cpu_head = layer(model.model.embed_tokens.weight, None)
        replaced += 1
    return replaced


def prepare_for_inference(model: nn.Module) -> int:
    """After loading: fuse the model's projections (every device and dtype) and, on CPU, load
    the compiled operators (backend/cpu_ops.py) and pack its linear layers where oneDNN can (bf16),
    else route fp32 decode steps' products through the few-rows kernel, and give the model its
    compiled decode loop where it can run (cpu_decode_layers.py); returns how many linears were
    packed."""
    model.fuse_projections()
    weight = model.model.embed_tokens.weight
    if weight.device.type != "cpu" or weight.dtype not in cpu_ops.DTYPES:
        return 0
    cpu_ops.load(cpu_flags())
    packed = pack_linears(model)
    if not packed and weight.dtype == torch.float32 and cpu_ops.available():
        _replace_linears(model, FewRowsLinear)
    cpu_decode_layers.attach(model)
    return packed
