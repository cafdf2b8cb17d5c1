"""The points of a `prefixgate tune --grid` sweep.

    --grid 'max_num_batched_tokens=512,1024,2048; max_num_seqs=16,32; kv_cache_dtype=auto,fp8'

A name is an engine flag in vLLM's spelling with underscores for dashes
(`max_num_batched_tokens` is `--max-num-batched-tokens` on the bundled engine and on vLLM), so
one grid runs on both; the points are the cross product of the values. For the bundled engine
each point is read from the engine's flag table, as the quality gate reads a candidate
(backend/config.py `setting_flags`: a name that is no engine setting, or a value it does not
take, fails before any engine starts); for another engine (`--engine-cmd`) a name becomes its
flag as it is, and `name=true,false` gives a switch or leaves it out.
`attention_backend=available` is every backend the engine can run on this device. Points whose
values change the numerics (backend/config.py `NUMERIC`) pass the quality gate before they can
be recommended.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from prefixgate.backend.config import NUMERIC, flag_name, setting_flags
from prefixgate.common.schema import ConfigError

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_SWITCH = {"true": True, "false": False}


class GridError(ValueError):
    """A grid that cannot be run, with what is wrong in it."""


@dataclass(frozen=True)
class Point:
    """One engine configuration: (name, value) pairs in grid order and the engine flags they
    make; none: the engine's defaults."""
    values: tuple[tuple[str, str], ...] = ()
    engine_flags: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.values) or "defaults"

    def flags(self) -> list[str]:
        return list(self.engine_flags)

    def numerics(self) -> tuple[tuple[str, str], ...]:
        """The values that change numerics away from the engine's defaults."""
        return tuple((k, v) for k, v in self.values if k in NUMERIC and v != NUMERIC[k])


def bundled_yaml(model: str, flags: list[str]) -> str:
    """Engine flags as the gateway config's `bundled:` block."""
    args = ", ".join(f'"{a}"' for a in flags)
    return f"bundled:\n  model: {model}\n  args: [{args}]\n"


def parse_grid(text: str, attention_backends: list[str] | None = None,
               bundled: bool = True) -> list[Point]:
    """`text`'s points (module doc); `attention_backends`: what `available` stands for;
    `bundled`: flags checked and made as the bundled engine takes them."""
    axes: list[tuple[str, list[str]]] = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        name, sep, values = (s.strip() for s in part.partition("="))
        if not sep or not _NAME.match(name):
            raise GridError(f"grid: {part!r} is not name=value,value,... (a flag's name with "
                            f"underscores, e.g. max_num_seqs=16,32)")
        if name in dict(axes):
            raise GridError(f"grid: {name} is given twice")
        listed = [v.strip() for v in values.split(",") if v.strip()]
        if name == "attention_backend" and "available" in listed:
            listed = [v for v in listed if v != "available"] + list(attention_backends or [])
        if not listed:
            raise GridError(f"grid: {name} has no values")
        axes.append((name, list(dict.fromkeys(listed))))
    if not axes:
        raise GridError("grid: no flags to sweep (e.g. --grid 'max_num_seqs=16,32')")
    names = [name for name, _ in axes]
    points = []
    for combo in itertools.product(*(values for _, values in axes)):
        values = tuple(zip(names, combo))
        points.append(Point(values, tuple(engine_flags(values, bundled))))
    return points


def engine_flags(values: tuple[tuple[str, str], ...], bundled: bool) -> list[str]:
    if bundled:
        spec = ",".join(f"{k}={v}" for k, v in values)
        try:
            return setting_flags(spec)
        except ConfigError as e:
            raise GridError(f"grid: {e}") from None
    out: list[str] = []
    for name, value in values:
        flag = flag_name(name)
        switch = _SWITCH.get(value.lower())
        if switch is None:
            out += [flag, value]
        elif switch:
            out.append(flag)
    return out
