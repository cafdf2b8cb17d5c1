"""The quality gate's candidates and `prefixgate tune`'s grid read engine settings from
backend/config.py's flag table: a bad name or value fails before any engine starts, naming
it; the points that change numerics are the table's."""
from __future__ import annotations

import pytest

from prefixgate.backend.config import FLAG, NUMERIC, SETTINGS
from prefixgate.proxy.bench.quality import SpecError, flags_from_spec
from prefixgate.proxy.tune.grid import GridError, parse_grid

BAD = [("dtype=float8", "dtype takes one of float32, bfloat16, float16, got 'float8'"),
       ("load_format=lazy", "load_format takes one of mmap, eager, got 'lazy'"),
       ("debug_kv_mantissa_bits=30", "debug_kv_mantissa_bits takes one of 0..22, got '30'"),
       ("block_size=1.5", "block_size takes an integer, got '1.5'"),
       ("kv_transfer_port=9000", "'kv_transfer_port' is no engine setting")]


@pytest.mark.parametrize("spec, message", BAD)
def test_a_candidate_with_a_bad_setting_names_it(spec, message):
    with pytest.raises(SpecError) as e:
        flags_from_spec(spec)
    assert str(e.value).startswith(f"candidate {spec!r}: ") and message in str(e.value)


@pytest.mark.parametrize("spec, message", BAD)
def test_a_grid_with_a_bad_setting_names_it(spec, message):
    with pytest.raises(GridError) as e:
        parse_grid(spec)
    assert str(e.value).startswith(f"grid: {spec!r}: ") and message in str(e.value)


def test_every_setting_is_a_grid_axis_and_a_candidate_and_numerics_are_the_tables():
    for name, f in SETTINGS.items():
        value = str(f.choices[0]) if f.choices is not None else "1"
        (point,) = parse_grid(f"{name}={value}")
        assert list(point.engine_flags) == flags_from_spec(f"{name}={value}")
        changes = name in NUMERIC and value != NUMERIC[name]
        assert point.numerics() == (((name, value),) if changes else ())
    assert flags_from_spec("enable_chunked_prefill=false") == [FLAG[
        "enable_chunked_prefill"].option]
