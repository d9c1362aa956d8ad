"""Typed reads of a config file: every key a family's config reader uses, with its type and range, in one table.

Each reader (`WanSpec.from_config`, `dit/checkpoints.diffusers_spec` / `spec_from_ours`) declares a table
{key: Key} and calls `read_keys(config, table, where)` once; nothing downstream converts or range-checks a config
value again. A value of the wrong type or out of range is one ConfigError naming the file, the key, what it holds
and what was expected, e.g.

    ConfigError: /models/wan: config.json's num_layers is 'two'; expected an integer >= 1

A missing key takes its default (a key with no default is required); JSON null is accepted only where the key
says so (`nullable`: diffusers writes `"out_channels": null` for "as many as in_channels"). Booleans are not
integers here (JSON `true` is no layer count), and an integer is a float where a float is asked for.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from dmd2_mega.errors import ConfigError

REQUIRED = object()
"""The default of a key the file must hold."""


@dataclass(frozen=True)
class Key:
    kind: type
    """int, float, bool or str."""
    default: Any = REQUIRED
    low: Optional[float] = None
    """Inclusive lower bound (ints), or exclusive (floats: `low` < value)."""
    high: Optional[float] = None
    """Exclusive upper bound (floats)."""
    choices: tuple = ()
    length: Optional[int] = None
    """A list (or tuple: a diffusers model's in-memory config) of exactly `length` values, each of `kind` within
    the bounds (e.g. Wan's patch_size)."""
    nullable: bool = False

    def expected(self) -> str:
        if self.choices:
            return f"one of {list(self.choices)}"
        one = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}[self.kind]
        if self.low is not None:
            one += f" {'>=' if self.kind is int else '>'} {self.low}"
        if self.high is not None:
            one += f"{' and' if self.low is not None else ''} < {self.high}"
        if self.length is not None:
            one = f"a list of {self.length} values, each {one}"
        return one + (" (or null)" if self.nullable else "")

    def valid(self, v: Any) -> bool:
        if self.length is not None:
            return isinstance(v, (list, tuple)) and len(v) == self.length and all(self._one(x) for x in v)
        return self._one(v)

    def _one(self, v: Any) -> bool:
        if self.kind is int:
            ok = isinstance(v, int) and not isinstance(v, bool) and (self.low is None or v >= self.low)
        elif self.kind is float:
            ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                  and (self.low is None or v > self.low) and (self.high is None or v < self.high))
        else:
            ok = isinstance(v, self.kind)
        return ok and (not self.choices or v in self.choices)


def count(default: Any = REQUIRED, nullable: bool = False) -> Key:
    """An integer >= 1 (a width, a layer count, a size)."""
    return Key(int, default, low=1, nullable=nullable)


def positive(default: Any = REQUIRED) -> Key:
    """A finite number > 0 (an eps, a ratio)."""
    return Key(float, default, low=0)


def read_keys(config: Any, keys: dict, where: str, file: str = "config.json", what: str = "the model") -> dict:
    """{key: checked value} for every key of `keys` (module docstring) in `config` (a JSON object: `read_json`
    refuses any other file); floats come back as float, lists as tuples."""
    out = {}
    for name, key in keys.items():
        if name not in config:
            if key.default is REQUIRED:
                raise ConfigError(f"{where}: {file} lacks {name!r}, which {what} needs ({key.expected()})")
            out[name] = key.default
            continue
        v = config[name]
        if not ((v is None and key.nullable) or (v is not None and key.valid(v))):
            raise ConfigError(f"{where}: {file}'s {name} is {v!r}; expected {key.expected()}")
        if v is not None and key.kind is float:
            v = float(v)
        out[name] = tuple(v) if isinstance(v, (list, tuple)) else v
    return out
