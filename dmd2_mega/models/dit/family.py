"""The DiT family's contract (`models/family.ModelFamily`): its model (`model.py`), the SiT / DiT layouts
(`checkpoints.py`: the official .pt and diffusers' DiTTransformer2DModel, both ways), its parameterisation adapters
(`parameterization.py`) and its planner maths (`plan.py`).

Recognises: one of our converted DiTs' config.json ({"_dmd2_family": "dit", ...}), a diffusers
DiTTransformer2DModel config.json (model folder or pipeline folder: its scheduler_config.json fixes the VP
schedule), and an official SiT / DiT .pt. Data: square images [C, H, H], class labels or embeddings [D] / [L, D].
Layouts: TP x DP (no token split). Exports to the layout a checkpoint was imported from.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional

import torch

from dmd2_mega.errors import ConfigError
from dmd2_mega.files.staging import staged_output
from dmd2_mega.files.json_file import read_json
from dmd2_mega.models.diffusers_folder import TRANSFORMER, iter_folder, write_model_folder
from dmd2_mega.models.dit.checkpoints import (DIFFUSERS_CLASS, diffusers_config, diffusers_spec, diffusers_to_ours,
                                              is_diffusers_config, is_our_config, official_spec, official_to_ours,
                                              our_config, ours_to_diffusers, ours_to_official, read_official_file,
                                              spec_from_ours)
from dmd2_mega.models.dit.model import DiT, DiTSpec
from dmd2_mega.models.dit.parameterization import build_adapter
from dmd2_mega.models.dit.plan import MATHS
from dmd2_mega.models.family import (BuildOptions, DataShape, ModelFamily, Source, check_state, expected_shapes,
                                     pick_weights)

SCHEDULER = "scheduler_config.json"
NEW_FILE, NEW_FOLDER = "export to a new file", "export into a new directory"


def model_folder(src: str, subfolder: Optional[str] = None) -> Optional[str]:
    """The model folder of a diffusers DiTTransformer2DModel folder or pipeline folder, else None."""
    if not os.path.isdir(src):
        return None
    for d in (src, os.path.join(src, subfolder or TRANSFORMER)):
        cfg = os.path.join(d, "config.json")
        if os.path.isfile(cfg) and is_diffusers_config(read_json(cfg)):
            return d
    return None


def _meta(spec: DiTSpec) -> DiT:
    with torch.device("meta"):
        return DiT(spec, spec.data_shape(), 1)


def timesteps(spec: DiTSpec, sigmas: list) -> list:
    """The network's own timesteps at our sigmas (what its parameterisation adapter feeds it)."""
    adapter = build_adapter(spec.parameterization, spec.beta_start, spec.beta_end, spec.num_train_timesteps)
    return adapter.inputs(torch.zeros(len(sigmas), 1), torch.tensor(sigmas, dtype=torch.float32))[1].tolist()


class DiTFamily(ModelFamily):
    name, title, spec_type = "dit", "DiT", DiTSpec
    reads = (f"dit: a diffusers {DIFFUSERS_CLASS} folder, a DiT converted by dmd2-mega or an official SiT / DiT "
             f".pt")
    splits_tokens = False
    export_layouts = ("diffusers", "official")
    lora_targets = ("qkv", "proj", "fc1", "fc2")  # attention (fused q, k, v; output), MLP
    plan = MATHS

    def build(self, spec, shape, tp_size=1, options=BuildOptions()):
        if options.causal is not None:
            raise ConfigError(f"--causal-chunk-frames: --model-size {spec.name} is a DiT, an image model with no "
                              f"frames to stream; causal students are video (the Wan family)")
        return DiT(spec, shape, tp_size, options)

    def default_shape(self, spec):
        return spec.data_shape()

    # ---- recognising
    def recognise(self, config_path, folder, name):
        """Our converted DiT's config.json, or a diffusers DiTTransformer2DModel's (its pipeline's scheduler config
        fixes the VP schedule); None for any other file."""
        if not config_path.endswith(".json"):
            return None
        config = read_json(config_path)
        if is_our_config(config):
            return spec_from_ours(config, name)
        if not is_diffusers_config(config):
            return None
        here = os.path.dirname(os.path.abspath(config_path))
        sched = next((p for p in (os.path.join(folder, "scheduler", SCHEDULER),
                                  os.path.join(os.path.dirname(here), "scheduler", SCHEDULER)) if os.path.isfile(p)),
                     None)
        return diffusers_spec(config, name, read_json(sched) if sched else None)

    def reads_source(self, src, subfolder=None):
        return os.path.isfile(src) or src.endswith((".pt", ".pth")) or model_folder(src, subfolder) is not None

    def open_source(self, src, subfolder=None, parameterization=None, num_heads=None):
        """An official SiT / DiT .pt (`parameterization` sit or vp-eps; `num_heads` unless a published size) or a
        diffusers DiTTransformer2DModel folder (`parameterization` overrides its scheduler's vp-eps); read whole."""
        if os.path.isfile(src) or src.endswith((".pt", ".pth")):
            raw = read_official_file(src)
            spec = official_spec(raw, src, parameterization or "", num_heads)
            state = official_to_ours(raw, spec, src)
        else:
            folder = model_folder(src, subfolder)
            if folder is None:
                raise ConfigError(f"{src}: not a diffusers {DIFFUSERS_CLASS} folder (config.json with that "
                                  f"_class_name, or a pipeline folder holding one in {TRANSFORMER}/)")
            spec = self.recognise(os.path.join(folder, "config.json"), src, src)
            if parameterization is not None:
                spec = replace(spec, parameterization=parameterization)
            state = diffusers_to_ours({k: t for _, k, t in iter_folder(folder)}, spec, folder)
        check_state(state, expected_shapes(_meta(spec)), src)

        def read(log):
            log(f"> read {src} ({spec.parameterization}: {spec.num_layers} layers, {spec.num_heads} heads, hidden "
                f"{spec.hidden_size}, patch {spec.patch_size}, {spec.in_channels} x {spec.sample_size}^2 latents, "
                f"{spec.num_classes} classes, {sum(t.numel() for t in state.values()):,} parameters)")
            return state
        return Source(spec, read, lambda save: {"config.json": our_config(replace(spec, name=os.path.abspath(save)))})

    # ---- converted checkpoints and exports
    def check_tp(self, spec, tp_size, where):
        if spec.num_heads % tp_size or int(spec.hidden_size * spec.mlp_ratio) % tp_size:
            raise ConfigError(f"--tensor-model-parallel-size {tp_size} must divide the {spec.num_heads} attention "
                              f"heads and the MLP width of {where}")

    def data_info(self, spec):
        """What a converted DiT was trained on (sample.py / eval need no --data)."""
        c, n = spec.in_channels, spec.sample_size
        return {"in_channels": c, "latent_shape": [c, n, n], "image_size": n, "num_classes": spec.num_classes,
                "cond_shape": None}

    def export(self, layout, load, out, payload, spec, ema, log):
        """Our DiT's weights in the layout it was imported from (the other cannot hold its timestep embedding)."""
        came_from = {0: "official", 1: "diffusers"}[spec.freq_shift] if spec.pos_table == "dit" else None
        if came_from != layout:
            hint = {"official": "--to-official FILE.pt", "diffusers": "--to-diffusers DIR"}.get(came_from)
            origin = (f"imported from the {came_from} layout" if came_from else
                      "trained by dmd2-mega (its own position table and timestep embedding)")
            raise ConfigError(f"--load {load}: this DiT was {origin}; it exports "
                              + (f"with {hint} only" if hint else "to no public layout"))
        which, state = pick_weights(payload, ema)
        state = {n: t.float() for n, t in state.items()}
        check_state(state, expected_shapes(_meta(spec)), f"--load {load}")
        official = layout == "official"
        with staged_output(out, f"--to-{layout}", not official, NEW_FILE if official else NEW_FOLDER, log) as where:
            if official:
                torch.save(ours_to_official(state, spec), where)
            else:
                write_model_folder(os.path.join(where, TRANSFORMER), ours_to_diffusers(state, spec),
                                   diffusers_config(spec))
        where = out if official else os.path.join(out, TRANSFORMER)
        sigmas = payload.get("student_sigmas")
        log(f"> wrote {where} ({which} weights of {load}, iteration {payload['iteration']}; a "
            f"{spec.parameterization} network" + (f"; the student's sigmas {sigmas}, its timesteps "
                                                  f"{[round(float(t), 4) for t in timesteps(spec, sigmas)]})"
                                                  if sigmas else ")"))
        return {"weights": which, "sigmas": sigmas, "iteration": payload["iteration"]}

    # ---- data and the planner
    def plan_data(self, spec, name, *, latent_shape, in_channels, image_size, num_classes, cond_shape, text_len):
        if text_len is not None:
            raise ConfigError(f"--text-len is for Wan; --model-size {name} (DiT) takes --cond-shape L D")
        channels, spatial = ((latent_shape[0], tuple(latent_shape[1:])) if latent_shape else (in_channels, image_size))
        cond_shape = tuple(cond_shape) if cond_shape else None
        return DataShape(channels, spatial, None if cond_shape else num_classes, cond_shape)

    def plan_spec(self, spec, name, shape, patch):
        if patch is not None:
            spec = replace(spec, patch_size=patch)
        if len(shape.spatial) != 2 or shape.spatial[0] != shape.spatial[1]:
            raise ConfigError(f"--model-size {name} (DiT) takes square images [C, H, H], got latents "
                              f"{[shape.in_channels, *shape.spatial]}")
        if shape.spatial[-1] % spec.patch_size:
            raise ConfigError(f"--image-size {shape.spatial[-1]} is not a multiple of --patch {spec.patch_size}")
        return spec

    def mlp_width(self, spec):
        return int(spec.hidden_size * spec.mlp_ratio)

    def describe(self, name, spec, latents, tokens, text_len):
        return (f"model {name}: hidden {spec.hidden_size}, {spec.num_layers} layers, {spec.num_heads} heads, patch "
                f"{spec.patch_size}; latents {latents} -> {tokens} tokens")


DIT = DiTFamily()
