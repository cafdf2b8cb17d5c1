"""The real-vLLM harness (proxy/testing/real_vllm.py) binds each server's OpenMP threads to a
core this process may use: a container's cores need not be numbered from 0."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from prefixgate.proxy.testing.real_vllm import core_sets


def test_servers_are_shared_out_over_the_cores_allowed():
    allowed = sorted(os.sched_getaffinity(0))
    assert core_sets(len(allowed)) == [str(c) for c in allowed]
    assert core_sets(len(allowed) + 1)[-1] == str(allowed[0])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_process_held_to_its_last_core_binds_every_server_there():
    last = max(os.sched_getaffinity(0))
    code = "from prefixgate.proxy.testing.real_vllm import core_sets; print(core_sets(2))"
    out = subprocess.run(["taskset", "-c", str(last), sys.executable, "-c", code],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == str([str(last), str(last)])
