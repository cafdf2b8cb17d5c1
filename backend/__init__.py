"""The bundled engine (docs/engine.md).

Importing the package turns on PyTorch's transparent huge pages for the engine's large
buffers: `THP_MEM_ALLOC_ENABLE=1`, PyTorch's own switch (its CPU allocator then aligns every
allocation of 2 MB or more to 2 MB and asks the kernel for huge pages, madvise(MADV_HUGEPAGE)),
unless the environment already sets it (`0` keeps 4 KB pages). PyTorch reads it once, at its
first allocation, so it is set here, before any engine module imports torch. Why: a decode step
reads every weight and its sequences' KV blocks, and a prefill streams activations through
the products; with 4 KB pages that is a TLB miss every 64 cache lines, and a page walk each.
SmolLM2 in bf16 on one core of the Xeon with AMX (`bench.steps`, both settings taking turns):
prefill of 512 tokens 0.200 -> 0.182-0.189 s, decode steps of 8 and 32 sequences at 1,024
tokens 57.4-57.9 -> 52.4-54.8 ms and 121-125 -> 111-114 ms, batch 1 within noise.
"""
import os

HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"
# whether the huge pages are this package's default (True) or the environment's own setting
HUGE_PAGES_BY_DEFAULT = HUGE_PAGES not in os.environ
os.environ.setdefault(HUGE_PAGES, "1")
