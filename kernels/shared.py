"""Helpers shared by the references and the Triton kernels: backend choice, FP8 scales.

Kept free of any Triton import so `import prefixgate.kernels` stays cheap on CPU and tests can
set TRITON_INTERPRET=1 before Triton is first imported.
"""
from __future__ import annotations

import os

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0 for e4m3fn
BACKENDS = ("torch", "triton")


def pick_backend(backend: str | None, t: torch.Tensor) -> str:
    """None / "auto": Triton for CUDA tensors, the PyTorch reference otherwise."""
    if backend in (None, "auto"):
        return "triton" if t.is_cuda else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected auto, torch or triton")
    return backend


def runnable_backends(device: str) -> list[str]:
    """The attention backends the engine can run on `device` ("cpu", "cuda", "cuda:1"): the
    PyTorch reference everywhere; Triton on CUDA, or on the CPU under its interpreter
    (TRITON_INTERPRET=1, for tests: far too slow to serve)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return ["torch", "triton"] if device.startswith("cuda") or interpreted else ["torch"]


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def kv_scales(scale, num_kv_heads: int, device) -> torch.Tensor:
    """Normalise a scale (None, float, 0-d / 1-element / [num_kv_heads] tensor) to float32
    [num_kv_heads].

    Scales matter only for FP8 caches (stored = value / scale); None means 1.0.
    """
    # Plain numbers become a device-side fill, not a host copy, so CUDA-graph capture stays legal.
    if scale is None:
        return torch.ones(num_kv_heads, dtype=torch.float32, device=device)
    if isinstance(scale, (int, float)):
        return torch.full((num_kv_heads,), float(scale), dtype=torch.float32, device=device)
    s = torch.as_tensor(scale, dtype=torch.float32, device=device).reshape(-1)
    if s.numel() == 1:
        return s.expand(num_kv_heads).contiguous()
    if s.numel() != num_kv_heads:
        raise ValueError(f"KV scale must be per tensor or per KV head ({num_kv_heads}), "
                         f"got {s.numel()} values")
    return s.contiguous()


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., num_kv_heads, head_dim] -> e4m3 with per-head scale [num_kv_heads], saturating."""
    y = x.float() / scale[:, None]
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)

