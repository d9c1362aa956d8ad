"""The DiT family <-> the public SiT / DiT checkpoint layouts: the official `.pt` state dict and diffusers'
`DiTTransformer2DModel` folder. Both hold full (TP=1) tensors; ours are the DiT's parameter names at TP=1.

Official (facebookresearch/DiT, willisma/SiT models.py; the file may wrap it as {"ema": ..., "model": ...}, and the
EMA weights are the ones the papers sample):
    x_embedder.proj.{weight [D, C, p, p], bias}   -> x_embed.*  (the conv's weight flattened: ours is (c, p, q))
    t_embedder.mlp.{0,2}.*                        -> t_embed.mlp.{0,2}.*
    y_embedder.embedding_table.weight [K + 1, D]  -> y_embed.table.weight (row K: the null class)
    pos_embed [1, T, D]                           -> checked against the fixed table (`embeddings.dit_sincos_2d`)
    blocks.N.attn.qkv.* [3D, ...] as [3, H, d]    -> blocks.N.qkv.inner.* as [H, 3, d] (each TP rank whole heads)
    blocks.N.attn.proj.*, mlp.fc1.*, mlp.fc2.*    -> blocks.N.proj / fc1 / fc2 .inner.*
    blocks.N.adaLN_modulation.1.*                 -> blocks.N.adaln.inner.*   (the same 6-way chunk order)
    final_layer.adaLN_modulation.1.*              -> final_adaln.inner.*
    final_layer.linear.* [p*p*C', D] as (p, q, c) -> final.* as (c, p, q); with learned sigma (C' = 2C) the
                                                     variance channels c >= C are dropped
Diffusers (models/transformers/dit_transformer_2d.py): pos_embed.proj -> x_embed; every block's
norm1.emb.{timestep_embedder.linear_{1,2}, class_embedder.embedding_table} -> t_embed / y_embed (diffusers keeps one
copy per block; they must be equal, block 0's is read); norm1.linear -> adaln; attn1.to_{q,k,v} -> qkv;
attn1.to_out.0 -> proj; ff.net.0.proj / ff.net.2 -> fc1 / fc2; proj_out_1 / proj_out_2 -> final_adaln / final.
Diffusers' DiT embeds the timestep with frequencies over half - 1 (`freq_shift` 1) and its MLP LayerNorm eps is
its config's norm_eps (1e-5); the official layout uses half and 1e-6. The spec records both, so an import is exact,
and an export goes back to the layout it came from (the other cannot represent its timestep embedding).
The model's spec comes from the tensors' shapes (official: heads from the published sizes, or given) or the
config; the parameterisation from the caller (official: SiT's interpolant or DiT's DDPM epsilon) or a diffusers
pipeline's scheduler_config.json (DDPM epsilon on linear betas).
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import MISSING, asdict, fields, replace
from typing import Optional

import torch

from dmd2_mega.errors import CheckpointError, ConfigError
from dmd2_mega.models.config_keys import REQUIRED, Key, count, positive, read_keys
from dmd2_mega.models.diffusers_folder import check_finite
from dmd2_mega.models.dit.model import DiTSpec
from dmd2_mega.models.embeddings import dit_sincos_2d
from dmd2_mega.models.dit.parameterization import KINDS

DIFFUSERS_CLASS = "DiTTransformer2DModel"
OURS_KEY = "_dmd2_family"
"""config.json of one of our converted DiT checkpoints: {OURS_KEY: "dit", **DiTSpec fields}."""
OFFICIAL_HEADS = {384: 6, 768: 12, 1024: 16, 1152: 16}
"""Heads of the published DiT / SiT sizes S, B, L, XL by hidden width."""


def _qkv_to_ours(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[3, H, d, ...] rows -> [H, 3, d, ...] rows (weight [3D, D] or bias [3D])."""
    return t.reshape(3, heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _qkv_from_ours(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _final_to_ours(t: torch.Tensor, p: int, channels: int) -> torch.Tensor:
    """Rows (p, q, c') with c' < C' -> rows (c, p, q) with c < C (the learned-sigma channels dropped)."""
    full = t.shape[0] // (p * p)
    return t.reshape(p, p, full, *t.shape[1:])[:, :, :channels].movedim(2, 0).reshape(channels * p * p, *t.shape[1:])


def _final_from_ours(t: torch.Tensor, p: int, channels: int) -> torch.Tensor:
    return t.reshape(channels, p, p, *t.shape[1:]).movedim(0, 2).reshape(t.shape)


# ---------------------------------------------------------------------------------------------- the official layout
_OFFICIAL_NAMES = [  # (official prefix, ours); {i} is a block index. qkv / final / the conv are reshaped apart
    ("x_embedder.proj.", "x_embed."),
    ("t_embedder.mlp.", "t_embed.mlp."),
    ("y_embedder.embedding_table.", "y_embed.table."),
    ("blocks.{i}.attn.qkv.", "blocks.{i}.qkv.inner."),
    ("blocks.{i}.attn.proj.", "blocks.{i}.proj.inner."),
    ("blocks.{i}.mlp.fc1.", "blocks.{i}.fc1.inner."),
    ("blocks.{i}.mlp.fc2.", "blocks.{i}.fc2.inner."),
    ("blocks.{i}.adaLN_modulation.1.", "blocks.{i}.adaln.inner."),
    ("final_layer.adaLN_modulation.1.", "final_adaln.inner."),
    ("final_layer.linear.", "final."),
]


def _rules(pairs) -> list:
    """(regex, replacement) rules from (source prefix, target prefix) templates."""
    return [("^" + re.escape(src).replace(re.escape("{i}"), r"(\d+)"), dst.replace("{i}", r"\1")) for src, dst in pairs]


_OFFICIAL = _rules(_OFFICIAL_NAMES)
_TO_OFFICIAL = _rules([(ours, official) for official, ours in _OFFICIAL_NAMES])


def _rename(name: str, rules) -> Optional[str]:
    for pat, rep in rules:
        new, n = re.subn(pat, rep, name)
        if n:
            return new
    return None


def read_official_file(path: str) -> dict:
    """The state dict of an official SiT / DiT `.pt` (the EMA weights of a training checkpoint)."""
    if not os.path.isfile(path):
        raise ConfigError(f"--from-official {path}: no such file (an official SiT / DiT checkpoint, e.g. "
                          f"SiT-XL-2-256x256.pt or DiT-XL-2-256x256.pt)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle / zip errors of a truncated or foreign file
        raise CheckpointError(f"{path}: cannot read as a torch state dict ({e})") from None
    if isinstance(state, dict) and isinstance(state.get("ema"), dict):
        state = state["ema"]
    elif isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict) or "x_embedder.proj.weight" not in state:
        raise CheckpointError(f"{path}: not an official SiT / DiT state dict (no x_embedder.proj.weight)")
    for key, t in state.items():
        if isinstance(t, torch.Tensor):
            check_finite(path, key, t)
    return state


def official_spec(state: dict, name: str, parameterization: str, num_heads: Optional[int] = None) -> DiTSpec:
    """The spec of an official state dict from its shapes (module docstring)."""
    if parameterization not in ("sit", "vp-eps"):
        raise ConfigError(f"--parameterization {parameterization}: an official checkpoint is SiT's (sit: linear "
                          f"interpolant, velocity) or DiT's (vp-eps: DDPM epsilon); say which")
    w = state["x_embedder.proj.weight"]
    hidden, channels, p = w.shape[0], w.shape[1], w.shape[2]
    heads = num_heads or OFFICIAL_HEADS.get(hidden)
    if heads is None:
        raise ConfigError(f"{name}: hidden size {hidden} is none of the published DiT / SiT sizes "
                          f"{sorted(OFFICIAL_HEADS)}; give --num-heads")
    if hidden % heads:
        raise ConfigError(f"--num-heads {heads} does not divide the hidden size {hidden} of {name}")
    layers = 1 + max((int(m.group(1)) for k in state if (m := re.match(r"blocks\.(\d+)\.", k))), default=-1)
    if "pos_embed" not in state or layers == 0:
        raise CheckpointError(f"{name}: no pos_embed / blocks.N.* tensors; not an official SiT / DiT state dict")
    tokens = state["pos_embed"].shape[-2]
    grid = math.isqrt(tokens)
    if grid * grid != tokens:
        raise CheckpointError(f"{name}: pos_embed has {tokens} tokens, not a square grid")
    out = state["final_layer.linear.weight"].shape[0] // (p * p)
    if out not in (channels, 2 * channels):
        raise CheckpointError(f"{name}: final_layer.linear has {out} output channels for {channels} input channels "
                              f"(expected {channels}, or {2 * channels} with learned sigma)")
    return DiTSpec(name=name, hidden_size=hidden, num_layers=layers, num_heads=heads, patch_size=p,
                   mlp_ratio=state["blocks.0.mlp.fc1.weight"].shape[0] / hidden,
                   freq_dim=state["t_embedder.mlp.0.weight"].shape[1], parameterization=parameterization,
                   pos_table="dit", in_channels=channels, sample_size=grid * p,
                   num_classes=state["y_embedder.embedding_table.weight"].shape[0] - 1)


def official_to_ours(state: dict, spec: DiTSpec, where: str) -> dict:
    """Our TP=1 state dict of an official state dict (module docstring); unknown keys are a CheckpointError."""
    out = {}
    for key, t in state.items():
        if key == "pos_embed":
            _check_pos_table(t, spec, where)
            continue
        name = _rename(key, _OFFICIAL)
        if name is None:
            raise CheckpointError(f"{where}: tensor {key!r} has no place in a DiT / SiT model")
        out[name] = t.float()
    return _reshape_to_ours(out, spec)


def _check_pos_table(t: torch.Tensor, spec: DiTSpec, where: str) -> None:
    """CheckpointError unless `t` is the fixed table in its own dtype's precision: a table computed in float64 and
    stored in dtype d is off by at most eps_d / 2 of the table's scale (1 for sin / cos); one computed in fp32 also
    carries its arguments' rounding, at most eps_fp32 / 2 x the grid side (sin is 1-Lipschitz). Tolerance: the larger
    of eps_d and eps_fp32 x grid, times the scale (an fp16 table: 9.8e-4; fp32 at grid 32: 3.8e-6)."""
    grid = spec.sample_size // spec.patch_size
    table = dit_sincos_2d(grid, spec.hidden_size)
    if not t.is_floating_point() or t.numel() != table.numel():
        raise CheckpointError(f"{where}: pos_embed is {t.dtype} {list(t.shape)}; the fixed sin-cos table of the DiT / "
                              f"SiT code is floating-point [1, {grid * grid}, {spec.hidden_size}]")
    atol = max(torch.finfo(t.dtype).eps, torch.finfo(torch.float32).eps * grid) * table.abs().max().item()
    err = (t.reshape(table.shape).float() - table).abs().max().item()
    if not err <= atol:
        raise CheckpointError(f"{where}: pos_embed is not the fixed sin-cos table of the DiT / SiT code (off by "
                              f"{err:.3g}; {t.dtype} rounding allows {atol:.2g})")


def ours_to_official(state: dict, spec: DiTSpec) -> dict:
    out = {_rename(name, _TO_OFFICIAL): t for name, t in _reshape_from_ours(state, spec).items()}
    out["pos_embed"] = dit_sincos_2d(spec.sample_size // spec.patch_size, spec.hidden_size)[None]
    return out


def _reshape_to_ours(state: dict, spec: DiTSpec) -> dict:
    p, c, heads = spec.patch_size, spec.in_channels, spec.num_heads
    for name in list(state):
        if name == "x_embed.weight":
            state[name] = state[name].flatten(1)
        elif re.match(r"blocks\.\d+\.qkv\.inner\.(weight|bias)$", name):
            state[name] = _qkv_to_ours(state[name], heads)
        elif name in ("final.weight", "final.bias"):
            state[name] = _final_to_ours(state[name], p, c)
    return state


def _reshape_from_ours(state: dict, spec: DiTSpec) -> dict:
    p, c, heads = spec.patch_size, spec.in_channels, spec.num_heads
    out = {}
    for name, t in state.items():
        if name == "x_embed.weight":
            t = t.reshape(spec.hidden_size, c, p, p)
        elif re.match(r"blocks\.\d+\.qkv\.inner\.(weight|bias)$", name):
            t = _qkv_from_ours(t, heads)
        elif name in ("final.weight", "final.bias"):
            t = _final_from_ours(t, p, c)
        out[name] = t.contiguous()
    return out


# ------------------------------------------------------------------------------------------- the diffusers layout
_BETA = Key(float, low=0, high=1)
_DIFFUSERS_KEYS = {  # what diffusers_spec reads of a DiTTransformer2DModel config.json (defaults: diffusers' DiT-XL/2)
    "num_attention_heads": count(16), "attention_head_dim": count(72), "in_channels": count(4),
    "out_channels": count(None, nullable=True), "num_layers": count(28), "patch_size": count(2),
    "norm_eps": positive(1e-5), "sample_size": count(32), "num_embeds_ada_norm": count(1000)}
_SCHEDULER_KEYS = {"beta_start": replace(_BETA, default=1e-4), "beta_end": replace(_BETA, default=0.02),
                   "num_train_timesteps": count(1000)}
_OUR_KEYS = {  # every DiTSpec field but name, typed; the defaults are DiTSpec's own (spec_from_ours)
    "hidden_size": count(), "num_layers": count(), "num_heads": count(), "patch_size": count(),
    "mlp_ratio": positive(), "freq_dim": count(), "parameterization": Key(str, choices=KINDS), "beta_start": _BETA,
    "beta_end": _BETA, "num_train_timesteps": count(), "pos_table": Key(str, choices=("ours", "dit")),
    "freq_shift": Key(int, choices=(0, 1)), "mlp_norm_eps": positive(), "in_channels": count(nullable=True),
    "sample_size": count(nullable=True), "num_classes": count(nullable=True)}


def is_diffusers_config(config: dict) -> bool:
    return isinstance(config, dict) and config.get("_class_name") == DIFFUSERS_CLASS


def is_our_config(config: dict) -> bool:
    return isinstance(config, dict) and config.get(OURS_KEY) == "dit"


def diffusers_spec(config: dict, name: str, scheduler: Optional[dict] = None,
                   parameterization: Optional[str] = None) -> DiTSpec:
    """The spec of a DiTTransformer2DModel config (+ a pipeline's scheduler config, which fixes the VP schedule)."""
    for key, want in (("norm_type", "ada_norm_zero"), ("activation_fn", "gelu-approximate"),
                      ("norm_elementwise_affine", False), ("attention_bias", True)):
        if config.get(key, want) != want:
            raise ConfigError(f"{name}: config.json has {key} {config[key]!r}; the DiT family takes {want!r}")
    c = read_keys(config, _DIFFUSERS_KEYS, name, what=f"a {DIFFUSERS_CLASS}")
    channels = c["in_channels"]
    out = c["out_channels"] or channels
    if out not in (channels, 2 * channels):
        raise ConfigError(f"{name}: out_channels {out} for in_channels {channels} (expected {channels}, or "
                          f"{2 * channels} with learned sigma)")
    kind = parameterization or "vp-eps"
    vp = {}
    if scheduler is not None:
        if scheduler.get("prediction_type", "epsilon") != "epsilon" or scheduler.get("beta_schedule",
                                                                                        "linear") != "linear":
            raise ConfigError(f"{name}: its scheduler predicts {scheduler.get('prediction_type')!r} on a "
                              f"{scheduler.get('beta_schedule')!r} beta schedule; the vp-eps adapter takes epsilon on "
                              f"linear betas")
        vp = read_keys(scheduler, _SCHEDULER_KEYS, name, "scheduler_config.json", "a DDPM schedule")
    return DiTSpec(name=name, hidden_size=c["num_attention_heads"] * c["attention_head_dim"],
                   num_layers=c["num_layers"], num_heads=c["num_attention_heads"], patch_size=c["patch_size"],
                   freq_dim=256, parameterization=kind, pos_table="dit", freq_shift=1, mlp_norm_eps=c["norm_eps"],
                   in_channels=channels, sample_size=c["sample_size"], num_classes=c["num_embeds_ada_norm"], **vp)


def diffusers_config(spec: DiTSpec) -> dict:
    return {"_class_name": DIFFUSERS_CLASS, "num_attention_heads": spec.num_heads,
            "attention_head_dim": spec.hidden_size // spec.num_heads, "in_channels": spec.in_channels,
            "out_channels": spec.in_channels, "num_layers": spec.num_layers, "sample_size": spec.sample_size,
            "patch_size": spec.patch_size, "activation_fn": "gelu-approximate",
            "num_embeds_ada_norm": spec.num_classes, "norm_type": "ada_norm_zero",
            "norm_elementwise_affine": False, "norm_eps": spec.mlp_norm_eps, "attention_bias": True}


def _block_rules(i: str) -> list:
    b = f"transformer_blocks.{i}."
    return [(b + "norm1.linear.", f"blocks.{i}.adaln.inner."), (b + "attn1.to_out.0.", f"blocks.{i}.proj.inner."),
            (b + "ff.net.0.proj.", f"blocks.{i}.fc1.inner."), (b + "ff.net.2.", f"blocks.{i}.fc2.inner.")]


_TOP = [("pos_embed.proj.", "x_embed."), ("proj_out_1.", "final_adaln.inner."), ("proj_out_2.", "final.")]
_EMB = [("timestep_embedder.linear_1.", "t_embed.mlp.0."), ("timestep_embedder.linear_2.", "t_embed.mlp.2."),
        ("class_embedder.embedding_table.", "y_embed.table.")]


def diffusers_to_ours(tensors: dict, spec: DiTSpec, where: str) -> dict:
    """Our TP=1 state dict of a DiTTransformer2DModel's tensors {diffusers name: tensor} (module docstring)."""
    out, qkv, emb = {}, {}, {}
    for key, t in tensors.items():
        t = t.float()
        m = re.match(r"transformer_blocks\.(\d+)\.(.*)$", key)
        if m and m.group(2).startswith("norm1.emb."):
            emb.setdefault(m.group(2)[len("norm1.emb."):], []).append((key, t))
            continue
        if m and (q := re.match(r"attn1\.to_([qkv])\.(weight|bias)$", m.group(2))):
            qkv.setdefault((m.group(1), q.group(2)), {})[q.group(1)] = t
            continue
        rules = _TOP + (_block_rules(m.group(1)) if m else [])
        name = next((ours + key[len(d):] for d, ours in rules if key.startswith(d)), None)
        if name is None:
            raise CheckpointError(f"{where}: tensor {key!r} has no place in a {DIFFUSERS_CLASS} the DiT family reads")
        out[name] = t
    for (i, kind), parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise CheckpointError(f"{where}: block {i} lacks some of attn1.to_q / to_k / to_v .{kind}")
        out[f"blocks.{i}.qkv.inner.{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    for sub, copies in emb.items():
        name = next((ours + sub[len(d):] for d, ours in _EMB if sub.startswith(d)), None)
        if name is None:
            raise CheckpointError(f"{where}: tensor {copies[0][0]!r} has no place in the DiT family")
        first = copies[0][1]
        for key, t in copies[1:]:
            if not torch.equal(t, first):
                raise CheckpointError(f"{where}: {key} differs from block 0's copy; the DiT family has one timestep "
                                      f"/ class embedder (diffusers' converted DiTs repeat it in every block)")
        out[name] = first
    return _reshape_to_ours(out, spec)


def ours_to_diffusers(state: dict, spec: DiTSpec) -> dict:
    out = {}
    for name, t in _reshape_from_ours(state, spec).items():
        m = re.match(r"blocks\.(\d+)\.qkv\.inner\.(weight|bias)$", name)
        if m:
            for letter, part in zip("qkv", t.chunk(3)):
                out[f"transformer_blocks.{m.group(1)}.attn1.to_{letter}.{m.group(2)}"] = part.contiguous()
            continue
        e = next(((d, ours) for d, ours in _EMB if name.startswith(ours)), None)
        if e is not None:
            for i in range(spec.num_layers):  # a copy each: safetensors refuses shared storage
                out[f"transformer_blocks.{i}.norm1.emb.{e[0]}{name[len(e[1]):]}"] = t.clone()
            continue
        b = re.match(r"blocks\.(\d+)\.", name)
        rules = _TOP + (_block_rules(b.group(1)) if b else [])
        out[next(d + name[len(ours):] for d, ours in rules if name.startswith(ours))] = t
    return out


# ------------------------------------------------------------------------------------------------ our config file
def our_config(spec: DiTSpec) -> dict:
    return {OURS_KEY: "dit", **asdict(spec)}


def spec_from_ours(config: dict, name: str) -> DiTSpec:
    """The spec of our converted DiT's config.json (`our_config`), every field typed and range-checked."""
    unknown = sorted(set(config) - set(_OUR_KEYS) - {"name", OURS_KEY})  # a DiTSpec field missing from _OUR_KEYS
    if unknown:                                                          # is refused here too, not dropped
        raise ConfigError(f"{name}/config.json: unknown DiT spec keys {unknown} (written by a newer dmd2-mega?)")
    defaults = {f.name: REQUIRED if f.default is MISSING else f.default for f in fields(DiTSpec)}
    c = read_keys(config, {k: replace(key, default=defaults[k]) for k, key in _OUR_KEYS.items()}, name,
                  what="a converted DiT")
    return DiTSpec(name=name, **c)
