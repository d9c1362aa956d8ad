"""The Wan family <-> diffusers `WanTransformer3DModel` folders: parameter names, tensor layouts, files.

Names (ours at TP=1 -> diffusers, `diffusers_name`; reading maps back through the names of the model the
spec builds); everything else is the same name and the same tensor:
    patch_embedding.weight [D, C*pt*ph*pw]         <-> patch_embedding.weight [D, C, pt, ph, pw]   (a Conv3d)
    condition_embedder.time_embedder.{0,2}.*       <-> condition_embedder.time_embedder.linear_{1,2}.*
    condition_embedder.text_embedder.{0,2}.*       <-> condition_embedder.text_embedder.linear_{1,2}.*
    *.inner.{weight,bias} (megatron linears)       <-> *.{weight,bias}
    blocks.N.attn{1,2}.to_out.inner.*              <-> blocks.N.attn{1,2}.to_out.0.*
    blocks.N.fc1.inner.* / fc2.inner.*             <-> blocks.N.ffn.net.0.proj.* / ffn.net.2.*
    condition_embedder.image_embedder.ff.{0,2}.*   <-> condition_embedder.image_embedder.ff.net.{0.proj,2}.*  (I2V)
A folder is a model folder (config.json + diffusion_pytorch_model.safetensors, or sharded with
diffusion_pytorch_model.safetensors.index.json) or a pipeline folder holding one under transformer/
(Wan 2.2 A14B: transformer/ and transformer_2/). `read_state` streams the shards one at a time into our
names (one full copy in host memory; `diffusers_folder.iter_folder` refuses a tensor two shards hold, a NaN / inf
weight and an index pointing outside the folder); `write_folder` writes a model folder diffusers loads (the family-neutral
file handling: `models/diffusers_folder.py`).
"""
from __future__ import annotations

import os
import re

import torch

from dmd2_mega.errors import CheckpointError, ConfigError
from dmd2_mega.files.json_file import read_json
from dmd2_mega.models.diffusers_folder import iter_folder, write_model_folder
from dmd2_mega.models.wan.model import DIFFUSERS_CLASS, WanSpec

_RULES = [  # (ours, diffusers), applied in order to a parameter name
    (r"^condition_embedder\.(time|text)_embedder\.0\.", r"condition_embedder.\1_embedder.linear_1."),
    (r"^condition_embedder\.(time|text)_embedder\.2\.", r"condition_embedder.\1_embedder.linear_2."),
    (r"^condition_embedder\.image_embedder\.ff\.0\.", r"condition_embedder.image_embedder.ff.net.0.proj."),
    (r"^condition_embedder\.image_embedder\.ff\.2\.", r"condition_embedder.image_embedder.ff.net.2."),
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
    return read_json(os.path.join(folder, "config.json"))


def read_state(folder: str, spec: WanSpec, expected: dict) -> dict:
    """Our TP=1 state dict from a model folder, shard by shard. `expected`: {our name: shape} of the model the
    spec builds (its diffusers names, `diffusers_name`, say where each tensor goes); a missing, unexpected or
    wrongly shaped tensor is a CheckpointError naming the file and key."""
    ours = {diffusers_name(n): n for n in expected}
    state = {}
    for path, key, t in iter_folder(folder):
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


def write_folder(out: str, state: dict, spec: WanSpec, dtype: torch.dtype | None = None,
                 extra_config: dict | None = None) -> None:
    """A diffusers WanTransformer3DModel folder from our TP=1 state dict; `extra_config`: keys added to its
    config.json (an "_"-prefixed key, which diffusers' config reader skips quietly)."""
    tensors = {diffusers_name(n): to_diffusers_tensor(n, t, spec) for n, t in state.items()}
    write_model_folder(out, tensors, {**spec.diffusers_config(), **(extra_config or {})}, dtype)
