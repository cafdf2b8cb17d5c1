"""The wheel is what users get: built from a copy of the checkout, installed (not editable)
into a fresh venv, its `prefixgate` answers every subcommand's --help and serves the demo model.

Nothing is downloaded: the fresh venv sees the dev venv's dependencies through a `.pth` file
naming the dev venv's site-packages (a plain path line: the editable install's finder, a .pth
file there too, is not run, so the checkout's prefixgate stays out), and pip installs the wheel
alone. Every command runs in a temporary folder, so the checkout is not on sys.path either.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest

from prefixgate.proxy.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
# what the copy of the checkout leaves out: build outputs, caches, environments, the tests
NOT_BUILT = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                                   ".pytest_cache", "bench-out", ".whl", ".gl", "tests")


def run(*cmd, cwd: Path, env: dict | None = None, timeout: float = 120):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout}{proc.stderr}"
    return proc.stdout


class Installed:
    """A fresh venv with the wheel installed: its python and `prefixgate`, and the environment
    (no PYTHONPATH, its bin/ first on PATH) and folder to run them in."""

    def __init__(self, venv: Path, cwd: Path):
        self.venv, self.cwd = venv, cwd
        self.python = venv / "bin" / "python"
        self.prefixgate = venv / "bin" / "prefixgate"
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.env["PATH"] = f"{venv / 'bin'}{os.pathsep}{self.env.get('PATH', '')}"

    def run(self, *cmd, timeout: float = 120) -> str:
        return run(*cmd, cwd=self.cwd, env=self.env, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist, venv, cwd = tmp / "src", tmp / "dist", tmp / "venv", tmp / "cwd"
    shutil.copytree(ROOT, src, ignore=NOT_BUILT)
    cwd.mkdir()
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
        "-q", "-w", dist, src, cwd=cwd)
    wheel, = dist.glob("prefixgate-*.whl")
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=cwd)
    env = Installed(venv, cwd)
    site = Path(env.run(env.python, "-c",
                        "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    (site / "dev_venv_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(sys.executable, "-m", "pip", "--python", env.python, "install", "--no-deps", "--no-index",
        "-q", wheel, cwd=cwd)
    return env


def subcommands() -> list[str]:
    parser = build_parser()
    action, = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return list(action.choices)


def test_the_wheel_is_what_runs(installed):
    out = installed.run(installed.python, "-c", "import prefixgate.proxy.tune, "
                        "prefixgate.proxy.cli as c, prefixgate.backend as b, importlib.resources "
                        "as r; print(c.__file__); print(b.__file__); "
                        "print(r.files('prefixgate.conf').joinpath('standalone.yaml').is_file(), "
                        "r.files('prefixgate.backend').joinpath('data').is_dir())")
    cli, backend, data = out.splitlines()
    for path in (cli, backend):
        assert Path(path).is_relative_to(installed.venv), path
    assert data == "True True"


def test_every_subcommand_answers_help(installed):
    names = subcommands()
    assert {"serve", "backend", "bench", "doctor", "tune", "verify-weights"} <= set(names)
    commands = [["--help"], *([name, "--help"] for name in names)]
    procs = {" ".join(cmd): subprocess.Popen([installed.prefixgate, *cmd], cwd=installed.cwd,
                                             env=installed.env, stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, text=True)
             for cmd in commands}
    for cmd, proc in procs.items():
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0, f"prefixgate {cmd}: exit {proc.returncode}\n{out}"
        assert "usage:" in out, out


def test_serve_demo_answers_a_chat_completion(installed):
    proc = subprocess.Popen([installed.prefixgate, "serve", "demo", "--port", "0"],
                            cwd=installed.cwd, env=installed.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 90
        while not (found := re.search(r"gateway listening on (http://\S+)", "".join(lines))):
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "serve: " + "".join(lines)
            lines.append(line)
        request = urllib.request.Request(
            found.group(1) + "/v1/chat/completions", method="POST",
            headers={"Content-Type": "application/json"},
            data=json.dumps({"model": "demo", "max_tokens": 4,
                             "messages": [{"role": "user", "content": "hello"}]}).encode())
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
            answer = json.load(response)
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"]["role"] == "assistant"
        assert answer["usage"]["completion_tokens"] >= 1
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            rest = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, "".join(lines) + rest
