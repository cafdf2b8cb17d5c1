"""A CPU engine keeps the memory its steps free for the next step (backend/model_runner.py's
keep_freed_host_memory): without it, glibc serves each block above 128 KiB with a fresh mmap
and hands it back on free, so every prefill step of the demo model page-faults 7-36k pages in
again (~15% of the step).

Read from glibc itself (`mallinfo2`), in a fresh process each (its settings are per process):
a step's temporaries of 1, 8 and 16 MiB, allocated and freed in turn, are mmapped without the
engine and come from the heap, which keeps them when freed, with it. (The page faults of whole
engine steps were counted here before: other threads and the heap's layout fault pages too,
and the counts with and without the setting overlapped, so the test failed in CI once.)"""
import ctypes
import json
import subprocess
import sys

import pytest

from prefixgate.backend.model_runner import keep_freed_host_memory

TEMPORARIES = """
import ctypes, json, sys, torch
torch.set_num_threads(1)
if sys.argv[1] == "engine":
    from prefixgate.backend.config import EngineArgs
    from prefixgate.backend.engine import LLMEngine
    LLMEngine(EngineArgs(model="demo", device="cpu"))
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
mapped, heap_kept = [], []
for size in (1 << 20, 8 << 20, 16 << 20):
    before = libc.mallinfo2().hblkhd           # bytes in mmapped blocks
    temporary = torch.empty(size // 4)
    mapped.append(libc.mallinfo2().hblkhd - before)
    heap = libc.mallinfo2().arena              # bytes of the heap
    del temporary
    heap_kept.append(libc.mallinfo2().arena == heap)
print(json.dumps({"mapped": mapped, "heap_kept": heap_kept}))
"""


def temporaries(process: str) -> dict:
    done = subprocess.run([sys.executable, "-c", TEMPORARIES, process], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"),
                    reason="glibc >= 2.33 only: the setting is glibc's, and so is mallinfo2")
def test_a_cpu_engine_keeps_freed_memory_for_the_next_step():
    plain, engine = temporaries("plain"), temporaries("engine")
    assert all(n >= 1 << 20 for n in plain["mapped"]), plain       # fresh mmaps each
    assert engine["mapped"] == [0, 0, 0], engine                    # from the heap ...
    assert all(engine["heap_kept"]), engine                         # ... which keeps them
    assert keep_freed_host_memory()                 # glibc accepts the thresholds (again)
