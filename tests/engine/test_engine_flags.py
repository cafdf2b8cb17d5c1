"""backend/config.py's table of engine flags (FLAGS) is the one owner of every flag of
`prefixgate backend`: EngineArgs has no field outside it, the backend's argparse is built from
it, the engine's KV cache dtypes are its names, and it stays importable without torch."""
from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from prefixgate.backend import cli as backend_cli
from prefixgate.backend.config import (
    DEFAULT_MODEL,
    ENGINE,
    FLAG,
    FLAGS,
    KV_CACHE_DTYPE_NAMES,
    NUMERIC,
    SERVER,
    SETTING,
    SETTINGS,
    EngineArgs,
    flag_name,
    setting_flags,
)
from prefixgate.backend.model_runner import KV_CACHE_DTYPES
from prefixgate.common.schema import ConfigError

ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}
# a value each setting takes, for the round trip through the backend's parser
SAMPLE = {str: "cpu", int: "3", float: "1.5", bool: "false"}


def test_every_engine_args_field_is_a_flag_of_the_table_and_nothing_else_is():
    engine = {f.name for f in FLAGS if f.engine}
    assert engine == set(ENGINE_FIELDS)
    assert len(FLAG) == len(FLAGS)                      # no name twice
    assert {f.scope for f in FLAGS} == {SETTING, ENGINE, SERVER}
    for f in FLAGS:
        if f.engine:
            # the flag's type is the field's (a structured flag's JSON text aside)
            assert f.type.__name__ in str(ENGINE_FIELDS[f.name].type) or f.name.endswith(
                "_config"), f.name


def test_defaults_are_the_engine_args_defaults():
    engine = EngineArgs()
    for f in FLAGS:
        if f.engine and f.name != "model":
            assert f.default == getattr(engine, f.name), f.name
    assert FLAG["model"].default == DEFAULT_MODEL       # the command serves the real model


def test_the_backend_parser_is_built_from_the_table():
    parser = backend_cli.build_parser()
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    assert list(actions) == [f.name for f in FLAGS]
    for f in FLAGS:
        action = actions[f.name]
        assert action.option_strings == [f.option]
        assert action.default == f.default
        assert (action.help == argparse.SUPPRESS) == f.hidden
        if f.type is bool:
            assert action.const is (not f.negated)    # the switch turns it on, or off
        else:
            assert action.type in (None, f.type) and action.metavar == f.metavar
            assert action.choices == (f.choices if f.parser_checks else None)
    assert FLAG["enable_prefix_caching"].option == "--no-prefix-caching"
    assert FLAG["max_num_batched_tokens"].option == "--max-num-batched-tokens"


def test_no_flags_give_the_default_engine_and_a_negated_switch_turns_its_feature_off():
    assert backend_cli.engine_args(backend_cli.build_parser().parse_args([])) == EngineArgs(
        model=DEFAULT_MODEL)
    ns = backend_cli.build_parser().parse_args(["--no-chunked-prefill", "--enforce-eager"])
    args = backend_cli.engine_args(ns)
    assert not args.enable_chunked_prefill and args.enable_prefix_caching and args.enforce_eager


def test_every_setting_reaches_the_backend_parser_through_setting_flags():
    parser = backend_cli.build_parser()
    for name, f in SETTINGS.items():
        value = str(f.choices[-1]) if f.choices is not None else SAMPLE[f.type]
        flags = setting_flags(f"{name}={value}")
        got = getattr(parser.parse_args(flags), name)
        assert str(got).lower() == value.lower(), (name, flags, got)


def test_numerics_are_named_with_the_value_that_changes_nothing():
    assert NUMERIC == {"dtype": None, "kv_cache_dtype": "auto", "attention_backend": "auto",
                       "debug_kv_mantissa_bits": None}
    for name, neutral in NUMERIC.items():
        assert name in SETTINGS
        assert neutral is None or (neutral == FLAG[name].default
                                   and neutral in FLAG[name].choices)


def test_the_kv_cache_dtypes_are_the_tables_names():
    assert tuple(KV_CACHE_DTYPES) == KV_CACHE_DTYPE_NAMES == FLAG["kv_cache_dtype"].choices


@pytest.mark.parametrize("spec, message", [
    ("kv_cache_dtype=fp9", "kv_cache_dtype takes one of auto, fp8, fp8_e4m3, float16, "
                           "bfloat16, float32, got 'fp9'"),
    ("dtype=float8", "dtype takes one of float32, bfloat16, float16, got 'float8'"),
    ("load_format=lazy", "load_format takes one of mmap, eager, got 'lazy'"),
    ("debug_kv_mantissa_bits=30", "debug_kv_mantissa_bits takes one of 0..22, got '30'"),
    ("kv_offloading_size=lots", "kv_offloading_size takes a number, got 'lots'"),
    ("enforce_eager=maybe", "enforce_eager takes true or false, got 'maybe'"),
    ("role=decode", "'role' is no engine setting"),
    ("port=8001", "'port' is no engine setting"),
])
def test_a_bad_setting_names_itself_and_the_spec(spec, message):
    with pytest.raises(ConfigError) as e:
        setting_flags(f"max_num_seqs=8,{spec}")
    assert str(e.value) == f"'max_num_seqs=8,{spec}': " + e.value.reason
    assert message in e.value.reason
    hidden = [f.name for f in FLAGS if f.hidden]
    assert hidden == ["debug_kv_mantissa_bits"]
    if "no engine setting" in message:        # the settings it lists are the visible ones
        assert all(name not in e.value.reason for name in hidden)
        assert all(name in e.value.reason for name in SETTINGS if name not in hidden)


def test_flag_names_are_vllms_spelling():
    assert flag_name("kv_offloading_size") == "--kv-offloading-size"
    assert [f.option for f in FLAGS if f.negated] == ["--no-chunked-prefill",
                                                      "--no-prefix-caching"]


def test_the_table_loads_without_torch():
    code = ("import sys; import prefixgate.backend.config as c; "
            "assert c.FLAGS and 'torch' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
