"""Precomputed latents + conditions in safetensors shards: the format behind `--data <dir>`.

Directory layout:
    <dir>/index.json
    <dir>/shard_00000.safetensors, shard_00001.safetensors, ...

index.json (class labels):
    {"shards": [{"file": "shard_00000.safetensors", "num_samples": 1024}, ...],
     "latent_shape": [C, H, W], "cond": "labels", "num_classes": K}
index.json (embeddings, e.g. text):
    {"shards": [...], "latent_shape": [C, H, W], "cond": "embedding", "cond_shape": [L, D]}

Each shard i holds (N_i = shards[i]["num_samples"]):
    latents  [N_i, C, H, W]          float32 / bfloat16 / float16 (any floating dtype); video [N_i, C, T, H, W]
    labels   [N_i]                   integer, values in [0, K)         (cond == "labels")
    cond     [N_i, *cond_shape]      floating                          (cond == "embedding")
All floating values must be finite. Null condition: class id K; for embeddings the negative-prompt
embedding in <dir>/negative.safetensors (tensor 'cond' [*cond_shape], optional), else all zeros: CFG's
negative branch (teacher sampling and the DMD2 teacher score) uses it, as Wan's recipes do.

`ShardDataset(path)` checks all of this at open time and raises `DataError` naming the file and
what was expected vs found; then it concatenates the shards in memory as float32 latents and
int64 labels / float32 embeddings. `write_shards` writes the format.
"""
import json
import os
from typing import List, Optional, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dmd2_mega.atomic import atomic_write
from dmd2_mega.errors import DataError
from .dataset import ImageDataset

INDEX = "index.json"
NEGATIVE = "negative.safetensors"


def _int_list(value, n: Optional[int], where: str, key: str) -> List[int]:
    ok = isinstance(value, list) and all(isinstance(v, int) and v > 0 for v in value)
    if not ok or (n is not None and len(value) != n):
        want = f"a list of {n} positive ints" if n is not None else "a list of positive ints"
        raise DataError(f"{where}: '{key}' must be {want}, found {value!r}")
    return value


def _read_index(path: str) -> dict:
    index_path = os.path.join(path, INDEX)
    if not os.path.isdir(path):
        raise DataError(f"--data {path}: not a directory (expected {INDEX} plus safetensors shards)")
    if not os.listdir(path):
        raise DataError(f"--data {path}: empty data directory (expected {INDEX} plus safetensors shards)")
    if not os.path.isfile(index_path):
        raise DataError(f"{index_path}: missing; a shard directory needs {INDEX} listing its shards")
    try:
        with open(index_path) as f:
            index = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{index_path}: cannot parse JSON ({e})") from e
    if not isinstance(index, dict):
        raise DataError(f"{index_path}: expected a JSON object, found {type(index).__name__}")
    shards = index.get("shards")
    if not isinstance(shards, list) or not shards:
        raise DataError(f"{index_path}: 'shards' must be a non-empty list of "
                        f"{{'file', 'num_samples'}}, found {shards!r}")
    for s in shards:
        if not (isinstance(s, dict) and isinstance(s.get("file"), str)
                and isinstance(s.get("num_samples"), int) and s["num_samples"] > 0):
            raise DataError(f"{index_path}: bad shard entry {s!r}; expected "
                            f"{{'file': str, 'num_samples': positive int}}")
    shape = _int_list(index.get("latent_shape"), None, index_path, "latent_shape")
    if len(shape) not in (3, 4):
        raise DataError(f"{index_path}: 'latent_shape' must be [C, H, W] or [C, T, H, W], found {shape}")
    kind = index.get("cond")
    if kind == "labels":
        k = index.get("num_classes")
        if not isinstance(k, int) or k < 1:
            raise DataError(f"{index_path}: cond 'labels' needs 'num_classes' >= 1, found {k!r}")
    elif kind == "embedding":
        _int_list(index.get("cond_shape"), None, index_path, "cond_shape")
    else:
        raise DataError(f"{index_path}: 'cond' must be 'labels' or 'embedding', found {kind!r}")
    return index


def _check_tensor(t: torch.Tensor, shape: Sequence[int], floating: bool, where: str, key: str):
    if tuple(t.shape) != tuple(shape):
        raise DataError(f"{where}: '{key}' expected shape {list(shape)}, found {list(t.shape)}")
    if floating:
        if not t.is_floating_point():
            raise DataError(f"{where}: '{key}' expected a floating dtype (float32/bfloat16/float16), "
                            f"found {t.dtype}")
        if not torch.isfinite(t).all():
            bad = int((~torch.isfinite(t)).sum())
            raise DataError(f"{where}: '{key}' has {bad} non-finite values (NaN/inf)")
    elif t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise DataError(f"{where}: '{key}' expected an integer dtype (int64), found {t.dtype}")


def _read_tensors(where: str, keys: Sequence[str]) -> list:
    """The named tensors of one safetensors file; a missing key or an unreadable file is a DataError naming it."""
    try:
        with safe_open(where, framework="pt") as f:
            found = set(f.keys())
            for key in keys:
                if key not in found:
                    raise DataError(f"{where}: expected tensor '{key}', found keys {sorted(found)}")
            return [f.get_tensor(k) for k in keys]
    except DataError:
        raise
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise DataError(f"{where}: cannot read as safetensors ({e})") from e


def _load_shard(path: str, entry: dict, index: dict) -> tuple:
    where = os.path.join(path, entry["file"])
    if not os.path.isfile(where):
        raise DataError(f"{where}: shard listed in {INDEX} is missing")
    cond_key = "labels" if index["cond"] == "labels" else "cond"
    latents, cond = _read_tensors(where, ("latents", cond_key))
    n = entry["num_samples"]
    _check_tensor(latents, [n, *index["latent_shape"]], True, where, "latents")
    if cond_key == "labels":
        _check_tensor(cond, [n], False, where, "labels")
        k = index["num_classes"]
        if n and (int(cond.min()) < 0 or int(cond.max()) >= k):
            raise DataError(f"{where}: 'labels' expected values in [0, {k}), found "
                            f"min {int(cond.min())}, max {int(cond.max())}")
    else:
        _check_tensor(cond, [n, *index["cond_shape"]], True, where, "cond")
    return latents.float(), cond


def _load_negative(path: str, cond_shape: tuple) -> torch.Tensor:
    where = os.path.join(path, NEGATIVE)
    neg, = _read_tensors(where, ("cond",))  # the negative-prompt embedding
    _check_tensor(neg, list(cond_shape), True, where, "cond")
    return neg.float()


class ShardDataset(ImageDataset):
    """A validated shard directory, held in memory (see the module docstring for the format)."""

    def __init__(self, path: str):
        index = _read_index(path)
        parts = [_load_shard(path, entry, index) for entry in index["shards"]]
        latents = torch.cat([p[0] for p in parts])
        if index["cond"] == "labels":
            cond, num_classes, cond_shape = torch.cat([p[1].long() for p in parts]), index["num_classes"], None
        else:
            cond, num_classes, cond_shape = torch.cat([p[1].float() for p in parts]), None, index["cond_shape"]
        self.path = path
        super().__init__(latents, cond, num_classes, cond_shape, source=os.path.join(path, INDEX))
        if num_classes is None and os.path.exists(os.path.join(path, NEGATIVE)):
            self.negative = _load_negative(path, tuple(cond_shape))


def write_shards(path: str, latents: torch.Tensor, labels: Optional[torch.Tensor] = None,
                 cond: Optional[torch.Tensor] = None, num_classes: Optional[int] = None,
                 shard_size: int = 4096, negative: Optional[torch.Tensor] = None) -> dict:
    """Write latents [N, C, H, W] with labels [N] (num_classes defaults to max + 1) or
    cond [N, *cond_shape] as `shard_size`-sample shards + index.json under `path`; returns the index.
    index.json is written last (via a temporary name), so a crash never leaves a readable partial set."""
    if (labels is None) == (cond is None):
        raise DataError("write_shards: pass exactly one of labels= or cond=")
    if latents.dim() not in (4, 5):
        raise DataError(f"write_shards: latents must be [N, C, H, W] or [N, C, T, H, W], got shape "
                        f"{tuple(latents.shape)}")
    c = labels if labels is not None else cond
    n = latents.shape[0]
    if c.shape[0] != n or n == 0 or shard_size < 1:
        raise DataError(f"write_shards: need N >= 1 latents with N conditions and shard_size >= 1; got "
                        f"{n} latents, {c.shape[0]} conditions, shard_size {shard_size}")
    index = {"shards": [], "latent_shape": list(latents.shape[1:])}
    if labels is not None:
        index.update(cond="labels", num_classes=int(num_classes if num_classes is not None
                                                    else int(labels.max()) + 1))
    else:
        index.update(cond="embedding", cond_shape=list(cond.shape[1:]))
    os.makedirs(path, exist_ok=True)
    key = "labels" if labels is not None else "cond"
    for i, start in enumerate(range(0, n, shard_size)):
        name = f"shard_{i:05d}.safetensors"
        sl = slice(start, start + shard_size)
        save_file({"latents": latents[sl].contiguous(), key: c[sl].contiguous()}, os.path.join(path, name))
        index["shards"].append({"file": name, "num_samples": int(latents[sl].shape[0])})
    if negative is not None:
        if cond is None or tuple(negative.shape) != tuple(cond.shape[1:]):
            raise DataError(f"write_shards: negative must be one embedding {list(c.shape[1:])} of text data, got "
                            f"{list(negative.shape)}")
        save_file({"cond": negative.contiguous()}, os.path.join(path, NEGATIVE))
    atomic_write(os.path.join(path, INDEX), lambda f: json.dump(index, f, indent=1), text=True)
    return index
