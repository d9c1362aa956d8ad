"""The one reader of a JSON settings file (a model or VAE config.json, a shard directory's index.json).

`read_json(path, flag="", error=ConfigError)` returns the file's top-level JSON object as a dict. Anything else is
ONE `error` line naming the file (after `flag`, the flag that gave it, when there is one):
    <flag> <path>: cannot read (<why>)          the file cannot be opened or read
    <flag> <path>: cannot parse JSON (<why>)    it is not UTF-8 JSON
    <flag> <path>: holds a JSON list; expected a JSON object ({"key": value, ...})
`error` is ConfigError for a model or settings file and DataError for a data file. What the object must hold is
the caller's check; whether the file exists may be too, when the caller has a better word for a missing one.
"""
from __future__ import annotations

import json
from typing import Type

from dmd2_mega.errors import ConfigError


def read_json(path: str, flag: str = "", error: Type[Exception] = ConfigError) -> dict:
    where = f"{flag} {path}" if flag else str(path)
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except OSError as e:
        raise error(f"{where}: cannot read ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{where}: cannot parse JSON ({e})") from None
    if not isinstance(value, dict):
        raise error(f"{where}: holds a JSON {type(value).__name__}; expected a JSON object ({{\"key\": value, ...}})")
    return value
