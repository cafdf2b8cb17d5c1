"""The engine's large buffers get transparent huge pages (backend/__init__.py), read from the
kernel itself: a fresh process imports the engine package, then torch, fills a 64 MiB tensor
and reports its AnonHugePages (/proc/self/smaps_rollup)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

FILL = """
import prefixgate.backend, torch
buffer = torch.empty(64 << 20, dtype=torch.uint8)
buffer.fill_(1)
text = open("/proc/self/smaps_rollup").read()
print(int(text.split("AnonHugePages:")[1].split()[0]))
"""


def kernel_mode() -> str | None:
    """always | madvise | never (the bracketed word), or None where the kernel has no THP."""
    if not THP_MODE.is_file():
        return None
    chosen = re.search(r"\[(\w+)\]", THP_MODE.read_text())
    return chosen.group(1) if chosen else None


def run_python(code: str, setting: str | None) -> list[str]:
    """The lines `code` prints in a fresh Python with THP_MEM_ALLOC_ENABLE unset, or `setting`."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if setting is not None:
        env["THP_MEM_ALLOC_ENABLE"] = setting
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return out.stdout.split()


def huge_kib(setting: str | None) -> int:
    return int(run_python(FILL, setting)[-1])


@pytest.mark.skipif(kernel_mode() not in ("always", "madvise"),
                    reason="the kernel gives no transparent huge pages here")
def test_the_engines_large_tensors_get_huge_pages_unless_the_environment_says_no():
    assert huge_kib(None) > 0                    # 2 MiB pages, as many as the kernel had
    if kernel_mode() == "madvise":               # only asked-for memory gets them
        assert huge_kib("0") == 0


def test_vllm_keeps_its_own_default_while_a_users_setting_reaches_it():
    code = ("import os; from prefixgate.proxy.testing.vllm_install import clean_env; "
            "vllms = clean_env().get('THP_MEM_ALLOC_ENABLE'); "
            "print(os.environ.get('THP_MEM_ALLOC_ENABLE'), vllms)")
    assert run_python(code, None) == ["1", "None"]     # set for the engine, not passed to vLLM
    assert run_python(code, "1") == ["1", "1"]
