"""A CPU engine keeps the memory its steps free for the next step (backend/model_runner.py's
keep_freed_host_memory): without it, glibc hands freed activations back to the OS and every
prefill step of the demo model page-faults 7-36k pages in again (~15% of the step)."""
import random
import resource

from prefixgate.backend.config import EngineArgs
from prefixgate.backend.engine import LLMEngine
from prefixgate.backend.model_runner import keep_freed_host_memory
from prefixgate.backend.sampling import SamplingParams


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_prefill_steps_reuse_freed_memory_instead_of_faulting_it_in():
    engine = LLMEngine(EngineArgs(model="demo", device="cpu"))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    faults = []
    # 3 x (512 + 512 + 176): chunks over a growing context
    for i in range(3):
        engine.add_request(f"r{i}", [rng.randrange(16, 4000) for _ in range(1200)], params)
        while engine.has_work():
            before = _faults()
            engine.step()
            faults.append(_faults() - before)
    # the first request grows the heap to its working set; later steps find it there
    assert max(faults[3:]) < 2000, faults
    assert keep_freed_host_memory()                 # glibc accepts the thresholds (again)
