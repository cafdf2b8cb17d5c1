"""The points of a `prefixgate tune --grid` sweep.

    --grid 'max_num_batched_tokens=512,1024,2048; max_num_seqs=16,32; kv_cache_dtype=auto,fp8'

A name is an engine flag in vLLM's spelling with underscores for dashes
(`max_num_batched_tokens` is `--max-num-batched-tokens` on the bundled engine and on vLLM), so
one grid runs on both; the points are the cross product of the values. A flag that takes no
value (`enforce_eager=true,false`) is given or left out. `attention_backend=available` is
every backend the engine can run on this device. Points whose values change the numerics
(`NUMERIC`) pass the quality gate before they can be recommended.
"""
from __future__ import annotations

import argparse
import itertools
import re
from dataclasses import dataclass

# flags that change what the model computes, not only how fast: the quality gate's business
NUMERIC = {"kv_cache_dtype": "auto", "attention_backend": "auto"}
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_SWITCH = {"true": True, "false": False}


class GridError(ValueError):
    """A grid that cannot be run, with what is wrong in it."""


@dataclass(frozen=True)
class Point:
    """One engine configuration: (name, value) pairs in grid order; none: the defaults."""
    values: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.values) or "defaults"

    def flags(self) -> list[str]:
        """The engine's command-line flags for this point."""
        out: list[str] = []
        for name, value in self.values:
            flag = "--" + name.replace("_", "-")
            switch = _SWITCH.get(value.lower())
            if switch is None:
                out += [flag, value]
            elif switch:
                out.append(flag)
        return out

    def numerics(self) -> tuple[tuple[str, str], ...]:
        """The values that change numerics away from the engine's defaults."""
        return tuple((k, v) for k, v in self.values if k in NUMERIC and v != NUMERIC[k])

    def bundled_yaml(self, model: str) -> str:
        """This point as the gateway config's `bundled:` block."""
        args = ", ".join(f'"{a}"' for a in self.flags())
        return f"bundled:\n  model: {model}\n  args: [{args}]\n"


def parse_grid(text: str, attention_backends: list[str] | None = None) -> list[Point]:
    """`text`'s points (module doc); `attention_backends`: what `available` stands for."""
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
    return [Point(tuple(zip(names, combo)))
            for combo in itertools.product(*(values for _, values in axes))]


def check_bundled(points: list[Point]) -> None:
    """Every point's flags, as the bundled engine's own parser reads them (a typo in a name
    or a value fails here, naming it, not after an engine start)."""
    from prefixgate.backend.cli import build_parser
    parser = build_parser()
    parser.exit_on_error = False
    known = {s for action in parser._actions for s in action.option_strings}
    for point in points:
        for name, _ in point.values:
            if "--" + name.replace("_", "-") not in known:
                raise GridError(f"grid: {name}: the bundled engine has no flag "
                                f"--{name.replace('_', '-')}")
        try:
            parser.parse_args(["--model", "demo", *point.flags()])
        except argparse.ArgumentError as e:
            raise GridError(f"grid: {point.label}: {e}") from None
