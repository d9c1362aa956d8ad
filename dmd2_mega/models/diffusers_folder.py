"""Diffusers model folders, whatever the model class: config.json, the safetensors weights (one file or shards
with an index), read tensor by tensor and written sharded. The families' name and layout mappings are in
`wan_diffusers.py` and `dit_checkpoints.py`.
"""
from __future__ import annotations

import json
import os
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dmd2_mega.atomic import atomic_write
from dmd2_mega.errors import CheckpointError, ConfigError

WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = WEIGHTS + ".index.json"
SHARD_BYTES = 5 * 2**30  # export shards at most this large (diffusers' own default is 10 GB)


def read_json(path: str) -> dict:
    """A JSON file (a config); ConfigError naming it when it cannot be read."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({e})") from None


def shard_files(folder: str) -> list[str]:
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({e})") from None
        for name in files:
            if not os.path.isfile(os.path.join(folder, name)):
                raise CheckpointError(f"{os.path.join(folder, name)}: shard listed in {INDEX} is missing")
        return [os.path.join(folder, n) for n in files]
    if os.path.isfile(os.path.join(folder, WEIGHTS)):
        return [os.path.join(folder, WEIGHTS)]
    found = sorted(n for n in os.listdir(folder) if n.endswith((".bin", ".pt", ".safetensors")))
    raise CheckpointError(f"{folder}: no {WEIGHTS} nor {INDEX}" + (f" (found {found}; only safetensors "
                          f"weights are read)" if found else ""))


def iter_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
    except CheckpointError:
        raise
    except Exception as e:  # safetensors' own errors for truncated / corrupt files
        raise CheckpointError(f"{path}: cannot read as safetensors (truncated or corrupt?): {e}") from None


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
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)
