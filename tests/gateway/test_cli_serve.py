"""`prefixgate serve` without a YAML file: --upstream URL ..., MODEL, --print-config."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import aiohttp
import pytest
import yaml

from tests.helpers import CONF, Serving

STANDALONE = yaml.safe_load((CONF / "standalone.yaml").read_text())
LISTEN = {"host": "127.0.0.1", "port": 8080}
METRICS = {"metrics": {}}


def run_cli(*args, timeout=20):
    return subprocess.run([sys.executable, "-m", "prefixgate.proxy.cli", "serve", *args],
                          capture_output=True, text=True, timeout=timeout)


def printed(*args) -> dict:
    proc = run_cli(*args, "--print-config")
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


@pytest.mark.parametrize("flags,plugins", [
    ([], [{"prefix_route": {"policy": "predicted_ttft"}}, METRICS]),     # measured best
    (["--policy", "round_robin"], [{"round_robin": {}}, METRICS]),
    (["--policy", "least_inflight", "--normalize"],
     [{"normalize": {}}, {"least_inflight": {}}, METRICS]),
    (["--policy", "chwbl"], [{"prefix_route": {"policy": "chwbl"}}, METRICS]),
    (["--policy", "cache_aware"], [{"prefix_route": {"policy": "cache_aware"}}, METRICS]),
])
def test_print_config_for_upstreams(flags, plugins):
    assert printed("--upstream", "http://10.0.0.1:8000", "--upstream", "https://b.example/",
                   *flags) == {
        "listen": LISTEN,
        "upstreams": [{"url": "http://10.0.0.1:8000"}, {"url": "https://b.example/"}],
        "plugins": plugins}


def test_print_config_for_a_model_dir_keeps_the_standalone_settings(tmp_path):
    (tmp_path / "config.json").write_text("{}")     # what makes a directory a model's
    assert printed(str(tmp_path), "--host", "0.0.0.0", "--port", "9000") == {
        **STANDALONE, "listen": {"host": "0.0.0.0", "port": 9000},
        "bundled": {**STANDALONE["bundled"], "model": str(tmp_path.resolve())}}
    with_policy = printed(str(tmp_path), "--policy", "cache_aware", "--normalize")
    assert with_policy["plugins"] == [{"normalize": {}},
                                      {"prefix_route": {"policy": "cache_aware"}}, METRICS]


def test_access_log_and_tracing_flags_become_their_config_sections():
    cfg = printed("--upstream", "http://10.0.0.1:8000", "--access-log", "-",
                  "--otlp-traces-endpoint", "http://collector:4318")
    assert cfg["access_log"] == {"path": "-"}
    assert cfg["tracing"] == {"otlp_endpoint": "http://collector:4318"}
    bad = run_cli("--upstream", "http://10.0.0.1:8000", "--otlp-traces-endpoint", "collector",
                  "--print-config")
    assert bad.returncode != 0 and "tracing.otlp_endpoint: must be an http(s) URL" in bad.stderr


def test_print_config_for_smollm2_and_for_nothing_is_the_standalone_config():
    assert STANDALONE["bundled"]["model"] == "smollm2"
    assert printed("smollm2") == STANDALONE
    assert printed() == STANDALONE
    assert printed("demo") == {**STANDALONE, "bundled": {**STANDALONE["bundled"],
                                                         "model": "demo"}}
    assert printed("--port", "0") == {**STANDALONE, "listen": {**STANDALONE["listen"],
                                                                "port": 0}}


def test_print_config_for_a_file_is_its_own_mapping_with_the_overrides(tmp_path):
    raw = {"upstreams": [{"name": "a", "url": "http://127.0.0.1:9"}],
           "plugins": [{"least_inflight": {}}, "metrics"]}
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert printed("--config", str(path)) == raw              # no defaults filled in
    assert printed("--config", str(path), "--port", "0") == {**raw, "listen": {"port": 0}}


@pytest.mark.parametrize("args,message", [
    (["--upstream", "ftp://x"], "upstreams[0].url: must start with http:// or https://"),
    (["--upstream", "http://a:1", "--upstream", "http://a:1"], "upstreams[1].name: duplicate"),
    (["--upstream", "http://a:1", "--port", "70000"], "listen.port: must be 0..65535"),
])
def test_a_bad_flag_value_names_the_key(args, message):
    for extra in ([], ["--print-config"]):
        proc = run_cli(*args, *extra)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"prefixgate: config error: {message}")
        assert proc.stdout == ""


@pytest.mark.parametrize("args,message", [
    (["--config", "gw.yaml", "--upstream", "http://a:1"], "--config and --upstream cannot"),
    (["--config", "gw.yaml", "some/dir"], "--config and MODEL cannot"),
    (["--upstream", "http://a:1", "demo"], "--upstream and MODEL cannot"),
    (["--upstream", "http://a:1", "http://b:2"], "give each upstream its own --upstream"),
    (["--config", "gw.yaml", "--policy", "chwbl"], "put the plugins in the YAML file"),
    (["--config", "gw.yaml", "--normalize"], "put the plugins in the YAML file"),
    (["--policy", "round_robin"], "--policy needs --upstream URL or MODEL"),
    (["--upstream", "http://a:1", "--policy", "random"], "invalid choice: 'random'"),
])
def test_conflicting_flags_are_refused(args, message):
    proc = run_cli(*args, "--print-config")
    assert proc.returncode == 2 and message in proc.stderr.splitlines()[-1], proc.stderr
    assert proc.stdout == ""


def test_a_missing_model_dir_fails_at_start_up_naming_it(tmp_path):
    missing = tmp_path / "no-such-model"
    for extra in ([], ["--print-config"]):
        proc = run_cli(str(missing), *extra)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and str(missing) in lines[0] and "does not exist" in lines[0]
    proc = run_cli(str(tmp_path))              # a directory, but no model in it
    assert proc.returncode == 2 and "nor a model directory (no config.json)" in proc.stderr
    (tmp_path / "gw.yaml").write_text("upstreams: []\n")
    proc = run_cli(str(tmp_path / "gw.yaml"))
    assert proc.returncode == 2 and f"did you mean --config {tmp_path / 'gw.yaml'}" in proc.stderr


async def chat(session, url, content, delay=0.0):
    body = {"model": "standin-model", "messages": [{"role": "user", "content": content}],
            "x_standin": {"first_delay": delay}}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        reply = await resp.json()
        return resp.headers["x-prefixgate-upstream"], reply["choices"][0]["message"]["content"]


async def test_upstreams_with_cache_aware_serve_chat_on_both(make_standin):
    a, b = await make_standin(), await make_standin()
    async with Serving("--upstream", a.url, "--upstream", b.url, "--policy", "cache_aware",
                       "--port", "0") as gw:
        names = {a.url.removeprefix("http://"), b.url.removeprefix("http://")}
        assert all(name in gw.output[-1] for name in names)     # named host:port
        async with aiohttp.ClientSession() as session:
            # unrelated prompts at once: no cached prefix, so the least loaded upstream
            replies = await asyncio.gather(*(
                chat(session, gw.url, f"question {i}: " + f"{i} " * 40, delay=0.3)
                for i in range(4)))
    assert {name for name, _ in replies} == names
    assert all(text.startswith("tok0") for _, text in replies)
    assert a.requests and b.requests


async def test_printed_config_round_trips_through_serve_config(make_standin, tmp_path):
    a, b = await make_standin(), await make_standin()
    proc = run_cli("--upstream", a.url, "--upstream", b.url, "--policy", "round_robin",
                   "--normalize", "--port", "0", "--print-config")
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "gw.yaml"
    path.write_text(proc.stdout)
    assert printed("--config", str(path)) == yaml.safe_load(proc.stdout)
    async with Serving("--config", str(path)) as gw:
        async with aiohttp.ClientSession() as session:
            replies = [await chat(session, gw.url, f"hello {i}") for i in range(4)]
    assert len({name for name, _ in replies}) == 2           # round robin: both, in turn
    assert len(a.requests) == len(b.requests) == 2
