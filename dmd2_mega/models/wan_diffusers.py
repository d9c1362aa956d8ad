"""The Wan family <-> diffusers `WanTransformer3DModel` folders: parameter names, tensor layouts, files.

Names (ours at TP=1 -> diffusers, `diffusers_name`; reading maps back through the names of the model the
spec builds); everything else is the same name and the same tensor:
    patch_embedding.weight [D, C*pt*ph*pw]         <-> patch_embedding.weight [D, C, pt, ph, pw]   (a Conv3d)
    condition_embedder.time_embedder.{0,2}.*       <-> condition_embedder.time_embedder.linear_{1,2}.*
    condition_embedder.text_embedder.{0,2}.*       <-> condition_embedder.text_embedder.linear_{1,2}.*
    *.inner.{weight,bias} (megatron linears)       <-> *.{weight,bias}
    blocks.N.attn{1,2}.to_out.inner.*              <-> blocks.N.attn{1,2}.to_out.0.*
    blocks.N.fc1.inner.* / fc2.inner.*             <-> blocks.N.ffn.net.0.proj.* / ffn.net.2.*
A folder is a model folder (config.json + diffusion_pytorch_model.safetensors, or sharded with
diffusion_pytorch_model.safetensors.index.json) or a pipeline folder holding one under transformer/
(Wan 2.2 A14B: transformer/ and transformer_2/). `read_state` streams the shards one at a time into our
names (one full copy in host memory); `write_folder` writes a model folder diffusers loads.
"""
from __future__ import annotations

import json
import os
import re
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dmd2_mega.atomic import atomic_write
from dmd2_mega.errors import CheckpointError, ConfigError
from dmd2_mega.models.wan import DIFFUSERS_CLASS, WanSpec

WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = WEIGHTS + ".index.json"
SHARD_BYTES = 5 * 2**30  # export shards at most this large (diffusers' own default is 10 GB)

_RULES = [  # (ours, diffusers), applied in order to a parameter name
    (r"^condition_embedder\.(time|text)_embedder\.0\.", r"condition_embedder.\1_embedder.linear_1."),
    (r"^condition_embedder\.(time|text)_embedder\.2\.", r"condition_embedder.\1_embedder.linear_2."),
    (r"\.to_out\.inner\.", r".to_out.0."),
    (r"\.fc1\.inner\.", r".ffn.net.0.proj."),
    (r"\.fc2\.inner\.", r".ffn.net.2."),
    (r"\.inner\.", r"."),
]
def diffusers_name(ours: str) -> str:
    for pat, rep in _RULES:
        ours = re.sub(pat, rep, ours)
    return ours


def to_diffusers_tensor(name: str, t: torch.Tensor, spec: WanSpec) -> torch.Tensor:
    if name == "patch_embedding.weight":
        return t.reshape(spec.hidden_size, spec.in_channels, *spec.patch_size)
    return t


def to_our_tensor(name: str, t: torch.Tensor) -> torch.Tensor:
    return t.flatten(1) if name == "patch_embedding.weight" else t


def model_dir(path: str, subfolder: str = "transformer") -> str:
    """The model folder of `path`: itself if it holds config.json, else its `subfolder`/."""
    if not os.path.isdir(path):
        raise ConfigError(f"--from-diffusers {path}: not a directory")
    for d in (path, os.path.join(path, subfolder)):
        if os.path.isfile(os.path.join(d, "config.json")):
            return d
    raise ConfigError(f"--from-diffusers {path}: no config.json there nor in {subfolder}/ (a diffusers "
                      f"{DIFFUSERS_CLASS} folder or a pipeline folder holding one)")


def read_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
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


def read_state(folder: str, spec: WanSpec, expected: dict) -> dict:
    """Our TP=1 state dict from a model folder, shard by shard. `expected`: {our name: shape} of the model the
    spec builds (its diffusers names, `diffusers_name`, say where each tensor goes); a missing, unexpected or
    wrongly shaped tensor is a CheckpointError naming the file and key."""
    ours = {diffusers_name(n): n for n in expected}
    state = {}
    for path in shard_files(folder):
        for key, t in iter_tensors(path):
            name = ours.get(key)
            if name is None:
                if key.startswith("norm_added_q"):  # diffusers ignores it too
                    continue
                raise CheckpointError(f"{path}: tensor {key!r} has no place in a {DIFFUSERS_CLASS} of this "
                                      f"config.json (weights and config disagree)")
            t = to_our_tensor(name, t)
            if tuple(t.shape) != tuple(expected[name]):
                raise CheckpointError(f"{path}: tensor {key!r} has shape {list(t.shape)}, config.json implies "
                                      f"{list(expected[name])} (weights and config disagree)")
            state[name] = t
    missing = [diffusers_name(n) for n in expected if n not in state]
    if missing:
        raise CheckpointError(f"{folder}: {len(missing)} tensors of the model are in none of its weight files, "
                              f"e.g. {missing[:3]} (a truncated or partial download?)")
    return state


def write_folder(out: str, state: dict, spec: WanSpec, dtype: torch.dtype | None = None) -> None:
    """A diffusers WanTransformer3DModel folder from our TP=1 state dict."""
    tensors = {diffusers_name(n): to_diffusers_tensor(n, t, spec) for n, t in state.items()}
    write_model_folder(out, tensors, spec.diffusers_config(), dtype)


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
