"""Diffusers model folders, whatever the model class: config.json, the safetensors weights (one file or shards
with an index), read tensor by tensor and written sharded. The families' name and layout mappings are in
`wan/diffusers.py` and `dit/checkpoints.py`.

What a read refuses (a CheckpointError naming the file and the tensor; nothing is converted from such a folder):
an index whose weight_map names a file outside the folder (absolute, or through ..), a tensor name held by two
shards (the later one would silently replace the first), and a floating-point tensor with a NaN or inf
(`check_finite`, also run on the official .pt files). Config files are read by `files/json_file.read_json`.
"""
from __future__ import annotations

import json
import os
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dmd2_mega.files.atomic import atomic_path, atomic_write
from dmd2_mega.files.json_file import read_json
from dmd2_mega.errors import CheckpointError

WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = WEIGHTS + ".index.json"
TRANSFORMER = "transformer"
"""The model folder inside a diffusers pipeline folder."""
SHARD_BYTES = 5 * 2**30  # export shards at most this large (diffusers' own default is 10 GB)


def shard_files(folder: str) -> list[str]:
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        weight_map = read_json(index, error=CheckpointError).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: not a safetensors index (no 'weight_map' object of tensor -> file)")
        for key, name in weight_map.items():
            if not isinstance(name, str) or os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] == "..":
                raise CheckpointError(f"{index}: weight_map puts tensor {key!r} in {name!r}, outside {folder}; a "
                                      f"shard is a file name inside the model folder")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(folder, name)):
                raise CheckpointError(f"{os.path.join(folder, name)}: shard listed in {INDEX} is missing")
        return [os.path.join(folder, n) for n in files]
    if os.path.isfile(os.path.join(folder, WEIGHTS)):
        return [os.path.join(folder, WEIGHTS)]
    found = sorted(n for n in os.listdir(folder) if n.endswith((".bin", ".pt", ".safetensors")))
    raise CheckpointError(f"{folder}: no {WEIGHTS} nor {INDEX}" + (f" (found {found}; only safetensors "
                          f"weights are read)" if found else ""))


def check_finite(path: str, key: str, t: torch.Tensor) -> None:
    """CheckpointError naming the file and the tensor when a floating-point tensor holds a NaN or an inf."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise CheckpointError(f"{path}: tensor {key!r} holds {bad} NaN / inf values of {t.numel()} (a corrupt or "
                              f"diverged checkpoint); only finite weights are converted")


def iter_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of one safetensors file, each checked finite (`check_finite`)."""
    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                check_finite(path, key, t)
                yield key, t
    except CheckpointError:
        raise
    except Exception as e:  # safetensors' own errors for truncated / corrupt files
        raise CheckpointError(f"{path}: cannot read as safetensors (truncated or corrupt?): {e}") from None


def iter_folder(folder: str) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(file, name, tensor) of every tensor of a model folder's weights, shard by shard (`shard_files`); a name
    that a later shard holds again is a CheckpointError naming both files."""
    seen = {}
    for path in shard_files(folder):
        for key, t in iter_tensors(path):
            if key in seen:
                raise CheckpointError(f"{path}: tensor {key!r} is also in {seen[key]}; a tensor belongs to one "
                                      f"shard (reading both would let the later copy replace the first)")
            seen[key] = path
            yield path, key, t


def write_model_folder(out: str, tensors: dict, config: dict, dtype: torch.dtype | None = None) -> None:
    """A diffusers model folder from {diffusers name: tensor}: config.json + safetensors (sharded past SHARD_BYTES)."""
    os.makedirs(out, exist_ok=True)
    tensors = {k: (v if dtype is None else v.to(dtype)).contiguous() for k, v in tensors.items()}
    shards, cur, size = [], {}, 0
    for k, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        if cur and size + nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = v, size + nbytes
    shards.append(cur)
    if len(shards) == 1:
        _save(shards[0], os.path.join(out, WEIGHTS))
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _save(shard, os.path.join(out, name))
            weight_map.update({k: name for k in shard})
        total = sum(v.numel() * v.element_size() for v in tensors.values())
        atomic_write(os.path.join(out, INDEX), lambda f: json.dump(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1), text=True)
    atomic_write(os.path.join(out, "config.json"), lambda f: json.dump(config, f, indent=1), text=True)


def _save(tensors: dict, path: str) -> None:
    """safetensors refuses tensors that share a storage (a checkpoint of a time-sliced role holds its weights as views
    of one buffer, `train/flat.py`): such a tensor is written from a copy of its own."""
    alone = {k: v if v.untyped_storage().nbytes() == v.numel() * v.element_size() else v.clone()
             for k, v in tensors.items()}
    with atomic_path(path) as tmp:
        save_file(alone, tmp, metadata={"format": "pt"})
