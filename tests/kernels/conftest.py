"""Kernel tests run Triton natively on CUDA, and under Triton's interpreter without it.

TRITON_INTERPRET=1 must be set before any Triton kernel is defined; our Triton modules are
imported lazily, so setting it here, when pytest loads this folder, is early enough even when
other test modules were imported first in the same process."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
