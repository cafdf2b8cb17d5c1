"""Speculative-decoding part of the kernel benchmark: the core of
`python -m prefixgate.backend.bench.speculative` on the GPU. Two engines on one model (prompt
lookup drafts vs plain decoding; Triton kernels, CUDA graphs for the steps without drafts),
stepped alternately, each request 128 greedy tokens; decode tok/s and TPOT p50 from each
request's first token, at batch 1 and 16, on the "quoting" workload (prompts whose greedy
output loops, picked by replaying the lookup) and the "free" one (text whose output does not).

The model is the demo one by default (its random weights give both workloads); `--spec-model
qwen2` takes the ~0.5B Qwen2-shaped random model of e2e.py instead (real compute per token, but
its greedy output nearly always repeats the last token, so only the quoting figures mean much),
or a model directory. `--cpu-smoke` runs the tiny e2e shape for one short round.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path


def bench_spec(a, device: str) -> dict:
    from prefixgate.backend.bench import speculative as sd
    from prefixgate.kernels.bench.e2e import QWEN2_0_5B, TINY, make_model_dir

    cpu = device == "cpu"
    with tempfile.TemporaryDirectory(prefix="prefixgate-bench-spec-") as tmp:
        if cpu:
            model = str(make_model_dir(Path(tmp) / "qwen2-tiny", TINY))
        elif a.spec_model == "qwen2":
            model = str(make_model_dir(Path(tmp) / "qwen2-random", QWEN2_0_5B))
        else:
            model = a.spec_model
        argv = ["--model", model, "--device", device, "--batches", a.spec_batches,
                "--rounds", str(a.spec_rounds)]
        if cpu:
            argv += ["--quick", "--dtype", "float32"]
        args = sd.parse_args(argv)
        result = sd.run(args)
    sd.report(result)
    ratios = {f"{c['workload']}_b{c['batch']}_ratio": c["ratio"] for c in result["cells"]}
    print(json.dumps(ratios), flush=True)
    return result
