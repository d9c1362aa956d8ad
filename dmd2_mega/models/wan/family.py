"""The Wan family's contract (`models/family.ModelFamily`): its model (`model.py`; Wan 2.2 A14B's two experts:
`experts.py`), the diffusers WanTransformer3DModel layout (`diffusers.py`, both ways; the export writer:
`export.py`) and its planner maths (`plan.py`).

Recognises: a WanTransformer3DModel config.json (a model folder, a pipeline folder holding one in transformer/, or
one of our checkpoints converted from one: its copied config.json); a pipeline folder whose model_index.json sets
boundary_ratio and which holds transformer_2/ (or a checkpoint converted from one: EXPERTS_FILE) is two experts.
Data: video latents [C, T, H, W], text embeddings [L, text_dim]. Layouts: TP x CP x DP, with sequence parallelism.
"""
from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Optional

import torch

from dmd2_mega.errors import ConfigError
from dmd2_mega.files.json_file import read_json
from dmd2_mega.models.diffusers_folder import TRANSFORMER
from dmd2_mega.models.family import BuildOptions, DataShape, ModelFamily, Source, expected_shapes
from dmd2_mega.models.wan.plan import MATHS
from dmd2_mega.models.wan.diffusers import model_dir, read_config, read_state
from dmd2_mega.models.wan.causal import CausalWan, check_causal
from dmd2_mega.models.wan.experts import EXPERTS, WanExperts
from dmd2_mega.models.wan.export import export_diffusers, export_lora
from dmd2_mega.models.wan.image import CLIP_LEN
from dmd2_mega.models.wan.model import DIFFUSERS_CLASS, TEXT_LEN, Wan, WanSpec, check_shape

EXPERTS_FILE = "wan_experts.json"
"""Written beside config.json in a checkpoint converted from a two-expert pipeline: {"boundary_ratio": r}."""


def boundary_ratio(folder: str):
    """The expert boundary of a two-expert Wan folder: a pipeline folder whose model_index.json sets boundary_ratio
    and which holds transformer_2/, or one of our checkpoints converted from one (EXPERTS_FILE); else None."""
    ours = os.path.join(folder, EXPERTS_FILE)
    index = os.path.join(folder, "model_index.json")
    for path, need in ((ours, None), (index, os.path.join(folder, EXPERTS[1], "config.json"))):
        if os.path.isfile(path) and (need is None or os.path.isfile(need)):
            ratio = read_json(path).get("boundary_ratio")
            if ratio is not None:
                return float(ratio)
    return None


def _is_wan(folder: str) -> bool:
    cfg = os.path.join(folder, "config.json")
    return os.path.isfile(cfg) and read_json(cfg).get("_class_name") == DIFFUSERS_CLASS


def _folders(src: str, subfolder: Optional[str]) -> tuple[WanSpec, dict]:
    """(spec, {parameter-name prefix: model folder}) of a diffusers folder: one model (prefix ""), or the two experts
    of a Wan 2.2 pipeline folder ("high.": transformer/, "low.": transformer_2/) unless `subfolder` picks one."""
    ratio = boundary_ratio(src) if subfolder is None and os.path.isdir(src) else None
    if ratio is None:
        folder = model_dir(src, subfolder or EXPERTS[0])
        return WanSpec.from_config(read_config(folder), folder), {"": folder}
    folders = {"high.": model_dir(src, EXPERTS[0]), "low.": model_dir(src, EXPERTS[1])}
    specs = [WanSpec.from_config(read_config(f), f) for f in folders.values()]
    if replace(specs[0], name="") != replace(specs[1], name=""):
        raise ConfigError(f"--from-diffusers {src}: {EXPERTS[0]}/ and {EXPERTS[1]}/ have different configs; the two "
                          f"experts of a Wan 2.2 pipeline share one")
    return replace(specs[0], boundary_ratio=ratio), folders


class WanFamily(ModelFamily):
    name, title, spec_type = "wan", "Wan", WanSpec
    reads = f"wan: a diffusers {DIFFUSERS_CLASS} folder or a Wan pipeline folder (one converted by dmd2-mega too)"
    splits_tokens = True
    export_layouts = ("diffusers", "diffusers-lora")
    lora_targets = ("to_q", "to_k", "to_v", "to_out", "fc1", "fc2")  # self- and cross-attention, FFN
    plan = MATHS

    def build(self, spec, shape, tp_size=1, options=BuildOptions()):
        """One Wan, Wan 2.2 A14B's two experts when the spec has a boundary_ratio (`experts.py`), or the causal
        student when the options carry a causal layout (`causal.py`)."""
        if options.causal is not None:
            check_causal(spec, options)
            return CausalWan(spec, shape, tp_size, options)
        return (WanExperts if spec.boundary_ratio is not None else Wan)(spec, shape, tp_size, options)

    def default_shape(self, spec):
        return spec.data_shape()

    def _meta(self, spec):
        with torch.device("meta"):
            return self.build(spec, spec.data_shape(), 1)

    # ---- recognising
    def recognise(self, config_path, folder, name):
        config = read_json(config_path)
        if config.get("_class_name") != DIFFUSERS_CLASS:
            return None
        spec = WanSpec.from_config(config, os.path.dirname(config_path) or config_path)
        ratio = boundary_ratio(folder)  # a model folder inside a pipeline (pipeline/transformer) is one model
        return replace(spec, boundary_ratio=ratio) if ratio is not None else spec

    def reads_source(self, src, subfolder=None):
        return os.path.isdir(src) and any(_is_wan(d) for d in (src, os.path.join(src, subfolder or TRANSFORMER)))

    def open_source(self, src, subfolder=None, parameterization=None, num_heads=None):
        """A model folder, or a pipeline folder: both experts of a Wan 2.2 A14B pipeline unless `subfolder` names
        one; read shard by shard (`diffusers.read_state`)."""
        if parameterization is not None or num_heads is not None:
            raise ConfigError(f"{src}: --parameterization / --num-heads describe an official SiT / DiT checkpoint; a "
                              f"{DIFFUSERS_CLASS} folder predicts our velocity and its config.json gives its heads")
        spec, folders = _folders(src, subfolder)

        def read(log):
            expected = expected_shapes(self._meta(spec))
            experts = f"two experts, boundary {spec.boundary_ratio}; " if spec.boundary_ratio is not None else ""
            log(f"> reading {', '.join(folders.values())} ({experts}{spec.num_layers} layers, {spec.num_heads} heads "
                f"x {spec.head_dim}, {sum(map(math.prod, expected.values())):,} parameters)")
            state = {}
            for prefix, folder in folders.items():
                part = {n[len(prefix):]: shape for n, shape in expected.items() if n.startswith(prefix)}
                state.update({prefix + n: t for n, t in read_state(folder, spec, part).items()})
            return state

        def files(save):
            out = {"config.json": os.path.join(next(iter(folders.values())), "config.json")}
            if spec.boundary_ratio is not None:
                out[EXPERTS_FILE] = {"boundary_ratio": spec.boundary_ratio, "experts": list(EXPERTS)}
            return out
        return Source(spec, read, files)

    # ---- converted checkpoints and exports
    def check_tp(self, spec, tp_size, where):
        if spec.num_heads % tp_size or spec.ffn_dim % tp_size:
            raise ConfigError(f"--tensor-model-parallel-size {tp_size} must divide the {spec.num_heads} attention "
                              f"heads and ffn_dim {spec.ffn_dim} of {where}")

    def export(self, layout, load, out, payload, spec, ema, log):
        if layout == "diffusers-lora":
            return export_lora(load, out, payload, spec, ema, log)
        return export_diffusers(load, out, payload, spec, self._meta(spec), ema, log)

    # ---- data and the planner
    def plan_data(self, spec, name, *, latent_shape, in_channels, image_size, num_classes, cond_shape, text_len):
        if latent_shape is None or len(latent_shape) != 4:
            raise ConfigError(f"--model-size {name} (Wan) takes video latents: give --latent-shape C T H W")
        if cond_shape is not None:
            raise ConfigError(f"--model-size {name} (Wan) reads text embeddings [L, {spec.text_dim}]: give "
                              f"--text-len L, not --cond-shape")
        text = (text_len or TEXT_LEN, spec.text_dim)
        if not spec.mask_channels:
            return DataShape(latent_shape[0], tuple(latent_shape[1:]), None, text)
        clip = (("clip", (CLIP_LEN, spec.image_dim)),) if spec.image_dim else ()  # I2V: text, CLIP, image latent
        return DataShape(latent_shape[0], tuple(latent_shape[1:]),
                         cond_parts=(("text", text), *clip, ("image", tuple(latent_shape))))

    def plan_spec(self, spec, name, shape, patch):
        if patch is not None:
            raise ConfigError(f"--patch applies to the DiT; --model-size {name} (Wan) has patch {spec.patch_size}")
        check_shape(spec, shape, 1)
        return spec

    def mlp_width(self, spec):
        return spec.ffn_dim

    def experts(self, spec):
        return len(spec.experts)

    def describe(self, name, spec, latents, tokens, text_len):
        experts = (f"; {len(spec.experts)} experts ({'/'.join(spec.experts)}, boundary {spec.boundary_ratio}) in "
                   f"every role, each sample runs one" if spec.experts else "")
        image = (f"; image-to-video: in_channels {spec.in_channels} (latent, mask, image latent)"
                 + (f", CLIP {CLIP_LEN} x {spec.image_dim}" if spec.image_dim else "") if spec.mask_channels else "")
        return (f"model {name} (Wan): hidden {spec.hidden_size}, {spec.num_layers} layers, {spec.num_heads} heads, "
                f"FFN {spec.ffn_dim}, patch {'x'.join(map(str, spec.patch_size))}; latents {latents} -> {tokens} "
                f"tokens, text {text_len} x {spec.text_dim}{image}{experts}")


WAN = WanFamily()
