"""Real checkpoints in and out: diffusers folders <-> our Megatron checkpoints, and a notebook API.

    import_diffusers(src, save, tp_size)   a diffusers WanTransformer3DModel folder (or a pipeline folder holding
                                           one in transformer/) -> a teacher checkpoint at TP=tp_size that
                                           --teacher-load / --critic-load / --student-load accept; the folder's
                                           config.json is copied to <save>/config.json so `--model-size <save>`
                                           builds the same spec
    export_diffusers(load, out, ema=True)  any of our Wan checkpoints (any TP; the student's EMA if it has one)
                                           -> out/transformer/ (WanTransformer3DModel.from_pretrained loads it),
                                           out/scheduler/scheduler_config.json (the student's few-step sigmas)
                                           and out/README.md (how to run it in WanPipeline)
    load_model(path)                       a diffusers folder, an official SiT / DiT .pt or one of our checkpoints
                                           -> a TP=1 fp32 CPU model, model(x, sigma, cond) -> velocity (DESIGN
                                           section 1; an imported SiT / DiT through its parameterisation adapter)
    import_dit(src, save, tp_size, ...)    an official SiT / DiT .pt or a diffusers DiTTransformer2DModel folder ->
                                           a teacher checkpoint of the DiT family, with <save>/config.json holding
                                           its spec (`models/dit_checkpoints.py`); import_diffusers sends a DiT
                                           folder here
    export_official(load, out) / export_diffusers(load, out)
                                           a DiT back to the layout it was imported from

Streaming: the import reads one safetensors shard at a time into one full copy (our layout), then writes each
TP rank's slice in turn (peak host memory: the full copy plus one rank's slice); nothing is written until every
tensor has been read and checked, so a bad folder leaves no checkpoint behind. The TP split of each parameter
comes from the model built on the meta device (no memory).
"""
from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import replace
from typing import Optional

import torch
import torch.distributed as dist

from dmd2_mega.files.atomic import atomic_write
from dmd2_mega.train.checkpoint import TRACKER, iter_dir, load_model_weights, load_payload, save_offline
from dmd2_mega.config import ParallelConfig
from dmd2_mega.errors import CheckpointError, ConfigError
from dmd2_mega.models import DataShape, FamilyModel, ModelSize, get_size
from dmd2_mega.models.registry import EXPERTS_FILE, boundary_ratio
from dmd2_mega.models.wan import WAN, WanSpec
from dmd2_mega.models.dit import DIT, DiTSpec
from dmd2_mega.models.dit_checkpoints import DIFFUSERS_CLASS as DIT_DIFFUSERS
from dmd2_mega.models.diffusers_folder import iter_folder, read_json, write_model_folder
from dmd2_mega.models.dit_checkpoints import (diffusers_config, diffusers_to_ours, is_diffusers_config, official_spec,
                                              official_to_ours, our_config, ours_to_diffusers, ours_to_official,
                                              read_official_file)
from dmd2_mega.models.parameterization import build_adapter
from dmd2_mega.models.wan_diffusers import model_dir, read_config, read_state, write_folder
from dmd2_mega.models.wan_experts import EXPERTS, WAN_EXPERTS
from dmd2_mega.distributed.parallel import ParallelState, init_distributed, tp_partition_dim
from dmd2_mega.files.staging import check_free, staged_output

NEW_CHECKPOINT = "convert into a new directory"  # how a taken --save / --to-* is refused
NEW_FOLDER, NEW_FILE = "export into a new directory", "export to a new file"

def _extra_states(model: torch.nn.Module) -> dict:
    """The non-tensor `_extra_state` entries megatron-core's linears add to a state dict (None here)."""
    return {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}


def _family(spec: WanSpec):
    return WAN_EXPERTS if spec.boundary_ratio is not None else WAN


def _meta_model(spec: WanSpec) -> FamilyModel:
    with torch.device("meta"):
        return _family(spec).build(spec, spec.data_shape(), 1)


def _one_process() -> ParallelState:
    return ParallelState(rank=0, world_size=1, local_rank=0, tp_rank=0, tp_size=1, dp_rank=0, dp_size=1,
                         device=torch.device("cpu"), backend="gloo")


def _source(src: str, subfolder: Optional[str]) -> tuple[WanSpec, dict]:
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


def _read_source(spec: WanSpec, folders: dict, expected: dict) -> dict:
    state = {}
    for prefix, folder in folders.items():
        part = {n[len(prefix):]: shape for n, shape in expected.items() if n.startswith(prefix)}
        state.update({prefix + n: t for n, t in read_state(folder, spec, part).items()})
    return state


def import_diffusers(src: str, save: str, tp_size: int = 1, subfolder: Optional[str] = None,
                     log=print) -> dict:
    """Convert (module docstring); returns {"spec", "parameters", "dir"}. A Wan 2.2 pipeline folder gives a
    two-expert checkpoint unless `subfolder` names one expert. A DiTTransformer2DModel folder goes to `import_dit`."""
    if _dit_folder(src, subfolder) is not None:
        return import_dit(src, save, tp_size, log=log)
    spec, folders = _source(src, subfolder)
    if spec.num_heads % tp_size or spec.ffn_dim % tp_size:
        raise ConfigError(f"--tensor-model-parallel-size {tp_size} must divide the {spec.num_heads} attention heads "
                          f"and ffn_dim {spec.ffn_dim} of {src}")
    check_free(save, "--save", True, NEW_CHECKPOINT)
    meta = _meta_model(spec)
    expected = {n: tuple(p.shape) for n, p in meta.named_parameters()}
    experts = f"two experts, boundary {spec.boundary_ratio}; " if spec.boundary_ratio is not None else ""
    log(f"> reading {', '.join(folders.values())} ({experts}{spec.num_layers} layers, {spec.num_heads} heads x "
        f"{spec.head_dim}, {sum(map(math.prod, expected.values())):,} parameters)")
    state = _read_source(spec, folders, expected)

    with staged_output(save, "--save", True, NEW_CHECKPOINT, log) as where:
        shutil.copyfile(os.path.join(next(iter(folders.values())), "config.json"), os.path.join(where, "config.json"))
        if spec.boundary_ratio is not None:
            atomic_write(os.path.join(where, EXPERTS_FILE), lambda f: json.dump(
                {"boundary_ratio": spec.boundary_ratio, "experts": list(EXPERTS)}, f), text=True)
        _write_converted(where, save, state, meta, tp_size, "wan", src, None)
    final = iter_dir(save, 0)
    log(f"> wrote {final} at TP={tp_size} ({tp_size} file{'s' if tp_size > 1 else ''}) and {save}/config.json")
    return {"spec": spec, "parameters": sum(t.numel() for t in state.values()), "dir": final}


def _dit_folder(src: str, subfolder: Optional[str] = None) -> Optional[str]:
    """The model folder of a diffusers DiTTransformer2DModel folder or pipeline folder, else None."""
    if not os.path.isdir(src):
        return None
    for d in (src, os.path.join(src, subfolder or "transformer")):
        cfg = os.path.join(d, "config.json")
        if os.path.isfile(cfg) and is_diffusers_config(read_json(cfg)):
            return d
    return None


def read_dit_source(src: str, parameterization: Optional[str] = None,
                    num_heads: Optional[int] = None) -> tuple[DiTSpec, dict]:
    """(spec, our TP=1 state dict) of an official SiT / DiT .pt file or a diffusers DiTTransformer2DModel folder
    (`models/dit_checkpoints.py`); shapes are checked against the model the spec builds."""
    _ensure_world()
    if os.path.isfile(src) or src.endswith((".pt", ".pth")):
        raw = read_official_file(src)
        spec = official_spec(raw, src, parameterization or "", num_heads)
        state = official_to_ours(raw, spec, src)
    else:
        folder = _dit_folder(src)
        if folder is None:
            raise ConfigError(f"{src}: not a diffusers {DIT_DIFFUSERS} folder (config.json with that _class_name, "
                              f"or a pipeline folder holding one in transformer/)")
        spec = get_size(src).spec
        if parameterization is not None:
            spec = replace(spec, parameterization=parameterization)
        state = diffusers_to_ours({k: t for _, k, t in iter_folder(folder)}, spec, folder)
    expected = {n: tuple(p.shape) for n, p in _meta_dit(spec).named_parameters()}
    _check_state(state, expected, src)
    return spec, state


def _meta_dit(spec: DiTSpec) -> FamilyModel:
    with torch.device("meta"):
        return DIT.build(spec, spec.data_shape(), 1)


def _check_state(state: dict, expected: dict, where: str) -> None:
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise CheckpointError(f"{where}: the tensors do not form the model its shapes / config describe "
                              f"(missing {missing[:3]}, unexpected {extra[:3]})")
    for n, shape in expected.items():
        if tuple(state[n].shape) != shape:
            raise CheckpointError(f"{where}: {n} has shape {list(state[n].shape)}, the model's is {list(shape)} "
                                  f"(weights and config disagree)")


def _dit_info(spec: DiTSpec) -> dict:
    """The data_info of a converted DiT: what it was trained on (sample.py / eval need no --data)."""
    c, n = spec.in_channels, spec.sample_size
    return {"in_channels": c, "latent_shape": [c, n, n], "image_size": n, "num_classes": spec.num_classes,
            "cond_shape": None}


def import_dit(src: str, save: str, tp_size: int = 1, parameterization: Optional[str] = None,
               num_heads: Optional[int] = None, log=print) -> dict:
    """An official SiT / DiT .pt or a diffusers DiT folder -> our teacher checkpoint at TP=tp_size, with
    <save>/config.json holding its spec (parameterisation, layout conventions, data shape)."""
    spec, state = read_dit_source(src, parameterization, num_heads)
    if spec.num_heads % tp_size or int(spec.hidden_size * spec.mlp_ratio) % tp_size:
        raise ConfigError(f"--tensor-model-parallel-size {tp_size} must divide the {spec.num_heads} attention heads "
                          f"and the MLP width of {src}")
    check_free(save, "--save", True, NEW_CHECKPOINT)
    log(f"> read {src} ({spec.parameterization}: {spec.num_layers} layers, {spec.num_heads} heads, hidden "
        f"{spec.hidden_size}, patch {spec.patch_size}, {spec.in_channels} x {spec.sample_size}^2 latents, "
        f"{spec.num_classes} classes, {sum(t.numel() for t in state.values()):,} parameters)")
    with staged_output(save, "--save", True, NEW_CHECKPOINT, log) as where:
        atomic_write(os.path.join(where, "config.json"), lambda f: json.dump(
            our_config(replace(spec, name=os.path.abspath(save))), f, indent=1), text=True)
        _write_converted(where, save, state, _meta_dit(spec), tp_size, "dit", src, _dit_info(spec))
    final = iter_dir(save, 0)
    log(f"> wrote {final} at TP={tp_size} and {save}/config.json")
    return {"spec": spec, "parameters": sum(t.numel() for t in state.values()), "dir": final}


def _write_converted(where: str, save: str, state: dict, meta: FamilyModel, tp_size: int, family: str, src: str,
                     data_info: Optional[dict]) -> str:
    """Our teacher checkpoint at TP=tp_size from a full TP=1 state dict (the split of each parameter from the meta
    model), written at `where` (the staged --save); `--model-size <save>` builds it from <save>/config.json,
    written by the caller."""
    dims = {n: tp_partition_dim(p) for n, p in meta.named_parameters()}
    args = {"model": {"size": os.path.abspath(save)}, "converted_from": os.path.abspath(src)}

    def payloads():  # one rank's shard at a time: replicated tensors as they are, split ones cloned (a view
        for r in range(tp_size):  # would save its whole storage)
            shard = {n: t if dims[n] is None else t.chunk(tp_size, dim=dims[n])[r].clone() for n, t in state.items()}
            yield {"model": {**shard, **_extra_states(meta)}, "partition_dims": dims, "tp_size": tp_size,
                   "iteration": 0, "role": "teacher", "family": family, "args": args, "data_info": data_info,
                   "checkpoint_version": 1}

    return save_offline(where, 0, payloads())


def checkpoint_spec(root: str, payload: dict) -> ModelSize:
    """(family, spec) of one of our checkpoints: <root>/config.json if present, else its --model-size."""
    if os.path.isfile(os.path.join(root, "config.json")):
        return get_size(root)
    size = ((payload.get("args") or {}).get("model") or {}).get("size")
    if not size:
        raise CheckpointError(f"{root}: the checkpoint records no --model-size and has no config.json")
    return get_size(size)


def _read_ours(root: str, flag: str) -> dict:
    payload = load_payload(root, _one_process(), flag=flag)  # every TP shard joined into TP=1
    if payload is None:
        raise CheckpointError(f"{flag} {root} holds no checkpoint (no {TRACKER})")
    return payload


def export_diffusers(load: str, out: str, ema: bool = True, log=print) -> dict:
    """Export (module docstring); returns {"weights": "ema" | "model", "sigmas": [...] or None}."""
    check_free(out, "--to-diffusers", True, NEW_FOLDER)
    payload = _read_ours(load, "--load")
    size = checkpoint_spec(load, payload)
    family, spec = size.family, size.spec
    if family.name == "dit":
        return _export_dit(load, out, payload, spec, ema, "diffusers", log)
    which = "ema" if ema and "ema" in payload else "model"
    state = {n: t for n, t in payload[which].items() if not n.endswith("_extra_state")}
    expected = {n: tuple(p.shape) for n, p in _meta_model(spec).named_parameters()}
    extra = sorted(set(state) - set(expected))
    if extra or set(expected) - set(state):
        raise CheckpointError(f"--load {load}: its weights do not form a Wan transformer of its config "
                              f"(unexpected {extra[:3]}, missing {sorted(set(expected) - set(state))[:3]}); "
                              f"export the student (--save), not the critic")
    prefixes = ("high.", "low.") if spec.boundary_ratio is not None else ("",)
    sigmas, info = payload.get("student_sigmas"), payload.get("data_info") or {}
    readme = _readme(load, which, sigmas, spec.boundary_ratio is not None, info.get("latent_shape"))
    with staged_output(out, "--to-diffusers", True, NEW_FOLDER, log) as where:
        for prefix, sub in zip(prefixes, EXPERTS):
            write_folder(os.path.join(where, sub), {n[len(prefix):]: t for n, t in state.items()
                                                    if n.startswith(prefix)}, spec)
        _write_scheduler(os.path.join(where, "scheduler"), sigmas)
        atomic_write(os.path.join(where, "README.md"), lambda f: f.write(readme), text=True)
    log(f"> wrote {out}/transformer ({which} weights of {load}, iteration {payload['iteration']}), "
        f"{out}/scheduler (sigmas {sigmas}) and {out}/README.md")
    return {"weights": which, "sigmas": sigmas, "iteration": payload["iteration"]}


def export_official(load: str, out: str, ema: bool = True, log=print) -> dict:
    """A DiT imported from the official SiT / DiT layout -> an official-layout .pt state dict (learn_sigma=False:
    the variance channels were dropped on import)."""
    check_free(out, "--to-official", False, NEW_FILE)
    payload = _read_ours(load, "--load")
    size = checkpoint_spec(load, payload)
    if size.family.name != "dit":
        raise ConfigError(f"--load {load} holds a {size.family.name} model; --to-official exports a SiT / DiT")
    return _export_dit(load, out, payload, size.spec, ema, "official", log)


def _export_dit(load: str, out: str, payload: dict, spec: DiTSpec, ema: bool, layout: str, log) -> dict:
    """Our DiT's weights in the layout it was imported from (the other cannot hold its timestep embedding)."""
    came_from = {0: "official", 1: "diffusers"}[spec.freq_shift] if spec.pos_table == "dit" else None
    if came_from != layout:
        hint = {"official": "--to-official FILE.pt", "diffusers": "--to-diffusers DIR"}.get(came_from)
        origin = (f"imported from the {came_from} layout" if came_from else
                  "trained by dmd2-mega (its own position table and timestep embedding)")
        raise ConfigError(f"--load {load}: this DiT was {origin}; it exports "
                          + (f"with {hint} only" if hint else "to no public layout"))
    which = "ema" if ema and "ema" in payload else "model"
    state = {n: t.float() for n, t in payload[which].items() if not n.endswith("_extra_state")}
    _check_state(state, {n: tuple(p.shape) for n, p in _meta_dit(spec).named_parameters()}, f"--load {load}")
    official = layout == "official"
    with staged_output(out, f"--to-{layout}", not official, NEW_FILE if official else NEW_FOLDER, log) as where:
        if official:
            torch.save(ours_to_official(state, spec), where)
        else:
            write_model_folder(os.path.join(where, "transformer"), ours_to_diffusers(state, spec),
                               diffusers_config(spec))
    where = out if official else os.path.join(out, "transformer")
    sigmas = payload.get("student_sigmas")
    log(f"> wrote {where} ({which} weights of {load}, iteration {payload['iteration']}; a {spec.parameterization} "
        f"network" + (f"; the student's sigmas {sigmas}, its timesteps "
                      f"{[round(float(t), 4) for t in _dit_timesteps(spec, sigmas)]})" if sigmas else ")"))
    return {"weights": which, "sigmas": sigmas, "iteration": payload["iteration"]}


def _dit_timesteps(spec: DiTSpec, sigmas: list) -> list:
    """The network's own timesteps at our sigmas (what its parameterisation adapter feeds it)."""
    adapter = build_adapter(spec.parameterization, spec.beta_start, spec.beta_end, spec.num_train_timesteps)
    return adapter.inputs(torch.zeros(len(sigmas), 1), torch.tensor(sigmas, dtype=torch.float32))[1].tolist()


def _write_scheduler(folder: str, sigmas: Optional[list]) -> None:
    """FlowMatchEulerDiscreteScheduler with stochastic sampling: each step predicts x0 and re-noises it to the next
    sigma with fresh noise, the DMD2 student's sampler; `sigmas` is the student's schedule (None: a teacher)."""
    cfg = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0,
           "use_dynamic_shifting": False, "stochastic_sampling": sigmas is not None}
    if sigmas is not None:
        cfg["_dmd2_student_sigmas"] = [float(s) for s in sigmas]  # "_": diffusers' config reader skips it quietly
    atomic_write(os.path.join(folder, "scheduler_config.json"), lambda f: json.dump(cfg, f, indent=1), text=True)


def _readme(load: str, which: str, sigmas, experts: bool, latent: Optional[list]) -> str:
    """How to run the export in WanPipeline, as written on a GPU (bf16) or the CPU (fp32): a student on its own
    sigmas without CFG, a teacher as Wan samples; at the frame count and size of `latent` ([C, T, H, W], the
    checkpoint's data_info; None: not recorded, a converted teacher). Only the two folder names are placeholders
    (`tests/test_export_atomic.py` runs it)."""
    load_t2 = ('transformer_2 = WanTransformer3DModel.from_pretrained("<this folder>", subfolder="transformer_2", '
               'torch_dtype=dtype)\n') if experts else ""
    parts = "transformer=transformer, " + ("transformer_2=transformer_2, " if experts else "")
    if latent is not None and len(latent) == 4:
        _, t, h, w = (int(n) for n in latent)
        size = (f"# the size it was trained at: latents [T, H, W] = [{t}, {h}, {w}], i.e. (T - 1) * 4 + 1 = {(t - 1) * 4 + 1} "
                f"frames of {8 * h} x {8 * w} with Wan's VAE\n"
                f"num_frames = {t - 1} * pipe.vae_scale_factor_temporal + 1\n"
                f"height, width = {h} * pipe.vae_scale_factor_spatial, {w} * pipe.vae_scale_factor_spatial\n")
        at = ", num_frames=num_frames, height=height, width=width"
    else:
        size = ("# the size it was trained at is not recorded (converted from a public checkpoint): give num_frames=,\n"
                "# height= and width= to pipe(...) (WanPipeline's default is 81 x 480 x 832)\n")
        at = ""
    if sigmas:
        run = (f"# the student's own sigmas: WanPipeline calls scheduler.set_timesteps(num_inference_steps), which gives\n"
               f"# diffusers' {len(sigmas)}-step grid, not these; without this line it samples at the wrong noise levels\n"
               f"pipe.scheduler.set_timesteps = functools.partial(pipe.scheduler.set_timesteps, "
               f"sigmas={[float(x) for x in sigmas]})\n{size}"
               f"# {len(sigmas)} steps, no CFG (the student was distilled with the teacher's guidance). Each step predicts x0\n"
               f"# and re-noises it to the next sigma with fresh noise (stochastic_sampling, the student's sampler), which\n"
               f"# WanPipeline draws from torch's global RNG (it passes no generator to scheduler.step): torch.manual_seed,\n"
               f"# not generator=, makes a video repeatable\n"
               f"torch.manual_seed(0)\n"
               f'video = pipe(prompt="...", guidance_scale=1.0, num_inference_steps={len(sigmas)}{at}).frames[0]\n')
    else:
        run = (f"{size}torch.manual_seed(0)  # the initial noise (no generator=) comes from torch's global RNG\n"
               f'video = pipe(prompt="...", num_inference_steps=50, guidance_scale=5.0{at}).frames[0]\n')
    return (f"# Exported by dmd2-mega from {load} ({which} weights)\n\n"
            f"Replace the two folder names; the rest runs as written, on a GPU in bf16 or on the CPU in fp32.\n\n"
            f"```python\nimport functools\nimport torch\n"
            f"from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel\n\n"
            f'device = "cuda" if torch.cuda.is_available() else "cpu"\n'
            f"dtype = torch.bfloat16 if device == \"cuda\" else torch.float32\n"
            f'transformer = WanTransformer3DModel.from_pretrained("<this folder>", subfolder="transformer", '
            f"torch_dtype=dtype)\n{load_t2}"
            f'scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained("<this folder>", subfolder="scheduler")\n'
            f'pipe = WanPipeline.from_pretrained("<the base Wan pipeline folder>", {parts}scheduler=scheduler,\n'
            f"                                   torch_dtype=dtype).to(device)\n{run}```\n")


def _ensure_world() -> None:
    """megatron-core's linears need its parallel state even at TP=1: a world of one if none exists."""
    if not dist.is_initialized():
        init_distributed(ParallelConfig())


def load_model(path: str, ema: bool = True, parameterization: Optional[str] = None,
               num_heads: Optional[int] = None) -> FamilyModel:
    """A diffusers folder, an official SiT / DiT .pt (give its `parameterization`: sit or vp-eps) or one of our
    checkpoints -> TP=1 fp32 CPU model in eval mode (module docstring)."""
    _ensure_world()
    if os.path.isfile(path) or _dit_folder(path) is not None:
        spec, state = read_dit_source(path, parameterization, num_heads)
        model = DIT.build(spec, spec.data_shape(), 1)
        load_model_weights(model, {**state, **_extra_states(model)}, path)
        return model.float().eval()
    if os.path.isfile(os.path.join(path, TRACKER)):
        payload = _read_ours(path, "load_model")
        size = checkpoint_spec(path, payload)
        family, spec = size.family, size.spec
        info = payload.get("data_info")
        model = family.build(spec, spec.data_shape() if info is None else DataShape.from_info(info), 1)
        state = {**payload["model"], **payload["ema"]} if ema and "ema" in payload else payload["model"]
        load_model_weights(model, state, path)
        return model.float().eval()
    spec, folders = _source(path, None)
    model = _family(spec).build(spec, spec.data_shape(), 1)
    state = _read_source(spec, folders, {n: tuple(p.shape) for n, p in model.named_parameters()})
    load_model_weights(model, {**state, **_extra_states(model)}, path)
    return model.float().eval()
