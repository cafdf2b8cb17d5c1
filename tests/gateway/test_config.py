"""A bad config fails at start-up with one line naming the key and the reason."""
from __future__ import annotations

import subprocess
import sys

import pytest

from prefixgate.common.schema import ConfigError
from prefixgate.proxy.app import Gateway
from prefixgate.proxy.config import gateway as config

GOOD = {"upstreams": [{"name": "a", "url": "http://127.0.0.1:9"}]}


@pytest.mark.parametrize("raw,message", [
    ({"upstreams": [{"name": "a"}]}, "upstreams[0].url: required"),
    ({"upstreams": [{"url": "http://x", "max_inflight": "many"}]},
     "upstreams[0].max_inflight: must be an integer"),
    ({"upstreams": [{"url": "http://x", "max_inflight": 0}]},
     "upstreams[0].max_inflight: must be > 0"),
    ({"upstreams": [{"url": "ftp://x"}]}, "upstreams[0].url: must start with http://"),
    ({"upstreams": [{"url": "http://x", "colour": "red"}]}, "upstreams[0].colour: unknown key"),
    ({**GOOD, "listne": {}}, "listne: unknown key"),
    ({**GOOD, "listen": {"port": "80"}}, "listen.port: must be an integer"),
    ({**GOOD, "listen": {"port": 70000}}, "listen.port: must be 0..65535"),
    ({**GOOD, "timeouts": {"first_byte": -1}}, "timeouts.first_byte: must be > 0"),
    ({**GOOD, "retries": True}, "retries: must be an integer"),
    ({"upstreams": [{"name": "a", "url": "http://x"}, {"name": "a", "url": "http://y"}]},
     "upstreams[1].name: duplicate"),
    ({}, "upstreams: required"),
    ({**GOOD, "plugins": [{"a": {}, "b": {}}]}, "plugins[0]: must be a plugin name"),
    ([1, 2], "must be a mapping"),
])
def test_validation_names_the_key(raw, message):
    with pytest.raises(ConfigError) as e:
        config.validate(raw)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("plugins,message", [
    ([{"metrics": {"slo_ttft_ms": "fast"}}], "plugins[0].metrics.slo_ttft_ms: must be a number"),
    (["metrics", {"round_robin": {"wieght": 2}}], "plugins[1].round_robin.wieght: unknown key"),
    (["no_such_plugin"], "plugins[0].no_such_plugin: unknown plugin"),
])
def test_plugin_settings_are_validated_when_the_chain_is_built(plugins, message):
    cfg = config.validate({**GOOD, "plugins": plugins})
    with pytest.raises(ConfigError) as e:
        Gateway(cfg)
    assert message in str(e.value)


def test_defaults_fill_in_and_per_upstream_timeouts_override():
    cfg = config.validate({"timeouts": {"idle": 5}, "upstreams": [
        {"url": "http://h:1/"}, {"url": "http://h:2", "timeouts": {"connect": 1}}]})
    assert cfg["listen"] == {"host": "127.0.0.1", "port": 8080, "workers": 1}
    a, b = cfg["upstreams"]
    assert a["url"] == "http://h:1" and a["name"] == "h:1"
    assert a["timeouts"] == {"connect": 5.0, "first_byte": 120.0, "idle": 5}
    assert b["timeouts"]["connect"] == 1 and b["timeouts"]["idle"] == 5


def run_cli(*args, timeout=20):
    return subprocess.run([sys.executable, "-m", "prefixgate.proxy.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("yaml_text,message", [
    ("upstreams:\n  - {name: a}\n", "upstreams[0].url: required"),
    ("upstreams: [\n", "invalid YAML at line"),
    ("upstreams:\n  - {url: 'http://x'}\nplugins:\n  - metrics: {slo_ttft_ms: []}\n",
     "plugins[0].metrics.slo_ttft_ms"),
    ("!!python/object/apply:os.system ['echo pwned']\n", "invalid YAML"),
])
def test_serve_with_a_bad_config_exits_with_one_line(tmp_path, yaml_text, message):
    path = tmp_path / "gw.yaml"
    path.write_text(yaml_text)
    proc = run_cli("serve", "--config", str(path))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("prefixgate: config error: ") and message in lines[0]
    assert "pwned" not in proc.stdout


def test_serve_with_a_missing_config_file(tmp_path):
    proc = run_cli("serve", "--config", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2 and "cannot read config" in proc.stderr


def test_bundled_load_format_is_checked_and_becomes_the_engines_flag():
    from prefixgate.backend.loader import LOAD_FORMATS
    from prefixgate.proxy.bundled import BundledEngines

    with pytest.raises(ConfigError,
                       match=r"bundled.load_format: must be one of mmap, eager \(got 'lazy'\)"):
        config.validate({"bundled": {"load_format": "lazy"}})
    for fmt in LOAD_FORMATS:        # the gateway lists the engine's formats without importing torch
        assert config.validate({"bundled": {"load_format": fmt}})["bundled"]["load_format"] == fmt
    bare = config.validate({"bundled": {}})
    assert BundledEngines(bare["bundled"]).engine_args() == []   # mmap: the default
    eager = config.validate({"bundled": {"load_format": "eager", "args": ["--max-num-seqs", "8"]}})
    assert BundledEngines(eager["bundled"]).engine_args() == ["--max-num-seqs", "8",
                                                              "--load-format", "eager"]
    own = config.validate({"bundled": {"load_format": "eager", "args": ["--load-format", "mmap"]}})
    # the args win
    assert BundledEngines(own["bundled"]).engine_args() == ["--load-format", "mmap"]
