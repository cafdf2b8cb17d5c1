"""The real-vLLM harness itself (proxy/testing/real_vllm.py): a port chosen for a server can be
taken before vLLM binds it (vLLM binds ports of its own while it starts; so do other servers
starting beside it). The server dies of it; the harness starts it again on fresh ports."""
from __future__ import annotations

import socket
import urllib.request

import pytest

from prefixgate.proxy.testing import real_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def test_a_server_whose_port_was_taken_starts_again_on_fresh_ports(monkeypatch, tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    # the ports a server takes in turn: HTTP, KV events, replay; the replay one (vLLM binds it)
    # already bound, as CI once found it
    picks = iter([None, None, taken.getsockname()[1]])
    free_port = real_vllm.free_port
    monkeypatch.setattr(real_vllm, "free_port", lambda: next(picks, None) or free_port())
    with taken, real_vllm.vllm_servers(1, log_dir=tmp_path, args=[
            "--max-model-len", "512", "--num-gpu-blocks-override", "8"]) as (server,):
        # chosen first, the taken port made the first start die: this is the second start
        assert server.replay_port != taken.getsockname()[1]
        with urllib.request.urlopen(server.url + "/v1/models", timeout=10) as r:
            assert r.status == 200
