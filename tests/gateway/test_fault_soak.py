"""A short soak run: the soak script's own checks (nothing lost, truncated or duplicated;
upstream counts match; RSS and fds flat) pass, with the gateway in its own process."""
from __future__ import annotations

import json
import subprocess
import sys


def test_short_soak_passes(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, "-m", "prefixgate.proxy.bench.soak", "--seconds", "6",
                           "--warmup-s", "2", "--concurrency", "16", "--sample-s", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert all(result["pass"].values()), result["pass"]
    assert result["requests"] > 100 and result["ok"] == result["requests"]
    assert result["upstream_completed"] == result["client_sent"]
    assert len(result["samples"]) >= 2
