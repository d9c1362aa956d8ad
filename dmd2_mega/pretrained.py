"""Real checkpoints in and out: public layouts <-> our Megatron checkpoints, and a notebook API.

    import_diffusers(src, save, tp_size)   a public model folder (or a pipeline folder holding one in
                                           transformer/) -> a teacher checkpoint at TP=tp_size that
                                           --teacher-load / --critic-load / --student-load accept, with the config
                                           files beside it that make `--model-size <save>` build the same spec
    import_dit(src, save, tp_size, parameterization, num_heads)
                                           the same, for a source that needs what its file cannot tell (an official
                                           SiT / DiT .pt: its parameterisation, maybe its heads)
    export_diffusers(load, out, ema=True)  any of our checkpoints (any TP; the student's EMA if it has one) -> the
    export_official(load, out, ema=True)   family's diffusers folder / official file (what each family writes:
                                           its `ModelFamily.export`)
    merge_lora_checkpoint(load, save)      a LoRA student -> full weights at TP=1
    load_model(path)                       a public folder, an official file or one of our checkpoints -> a TP=1
                                           fp32 CPU model, model(x, sigma, cond) -> velocity (DESIGN section 1; an
                                           imported SiT / DiT through its parameterisation adapter)

Which family a folder or file belongs to, its spec, its tensors and its export are the family's (`models/`:
`registry.source_family`, `ModelFamily.open_source` / `export`); this module is the family-neutral part: the
checkpoint's TP shards, the staged all-or-nothing output and the notebook loader. A source no family reads is one
ConfigError naming it and the families tried.

A conversion's `save` (import_*, merge_lora_checkpoint) that already holds checkpoints is refused, as a trainer's
--save is (`train/checkpoint_guard.check_fresh_save`), unless `overwrite` (--overwrite-save): then the new
checkpoint is written staged, the old folder waits at <save>.overwritten/ while it is renamed into place, and is
removed after (put back if the write fails; a killed run leaves it there, never deleted).
A causal student (its checkpoint's args record --causal; `models/causal.py`) has no public layout that runs it as
trained: diffusers' WanTransformer3DModel / WanPipeline attend over the whole clip. Its export is refused, naming
launch/sample.py --stream, unless `allow_bidirectional` (--allow-bidirectional-export): then the family writes the
chunking into the export (Wan: transformer/config.json's `_dmd2_causal`, which diffusers ignores) and a README
that says the pipeline runs it with full attention.

Streaming: the import reads one safetensors shard at a time into one full copy (our layout), then writes each
TP rank's slice in turn (peak host memory: the full copy plus one rank's slice); nothing is written until every
tensor has been read and checked, so a bad folder leaves no checkpoint behind. The TP split of each parameter
comes from the model built on the meta device (no memory).
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from dmd2_mega.files.atomic import atomic_write
from dmd2_mega.train.checkpoint import TRACKER, iter_dir, load_model_weights, load_payload, save_offline
from dmd2_mega.train.checkpoint_guard import check_fresh_save, holds_checkpoints
from dmd2_mega.train.lora_checkpoint import merged_payload
from dmd2_mega.config import ModelConfig, ParallelConfig
from dmd2_mega.errors import CheckpointError, ConfigError
from dmd2_mega.models import (FAMILIES, BuildOptions, DataShape, FamilyModel, ModelFamily, ModelSize, get_size,
                              source_family)
from dmd2_mega.models.family import causal_words, saved_causal
from dmd2_mega.distributed.parallel import ParallelState, init_distributed, tp_partition_dim
from dmd2_mega.files.staging import check_free, staged_output

NEW_CHECKPOINT = "convert into a new directory"  # how a taken --save / --to-* is refused
NEW_FOLDER, NEW_FILE = "export into a new directory", "export to a new file"
OVERWRITTEN = ".overwritten"  # <save>.overwritten/: what --overwrite-save replaces, while the new checkpoint moves in
EXPORT_FLAGS = {"diffusers": "--to-diffusers", "official": "--to-official",
                "diffusers-lora": "--to-diffusers --lora-only"}  # what the user gave for each layout


def _extra_states(model: torch.nn.Module) -> dict:
    """The non-tensor `_extra_state` entries megatron-core's linears add to a state dict (None here)."""
    return {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}


def _meta_model(family: ModelFamily, spec) -> FamilyModel:
    with torch.device("meta"):
        return family.build(spec, family.default_shape(spec), 1)


def _one_process() -> ParallelState:
    return ParallelState(rank=0, world_size=1, local_rank=0, tp_rank=0, tp_size=1, dp_rank=0, dp_size=1,
                         device=torch.device("cpu"), backend="gloo")


def import_diffusers(src: str, save: str, tp_size: int = 1, subfolder: Optional[str] = None,
                     log=print, overwrite: bool = False) -> dict:
    """Convert (module docstring); returns {"spec", "parameters", "dir"}. A Wan 2.2 pipeline folder gives a
    two-expert checkpoint unless `subfolder` names one expert. `overwrite` (--overwrite-save): replace the
    checkpoints `save` holds (module docstring)."""
    return _import(src, save, tp_size, subfolder, None, None, log, overwrite)


def import_dit(src: str, save: str, tp_size: int = 1, parameterization: Optional[str] = None,
               num_heads: Optional[int] = None, log=print, overwrite: bool = False) -> dict:
    """An official SiT / DiT .pt or a diffusers DiT folder -> our teacher checkpoint at TP=tp_size, with
    <save>/config.json holding its spec (parameterisation, layout conventions, data shape)."""
    return _import(src, save, tp_size, None, parameterization, num_heads, log, overwrite)


def check_save(save: str, overwrite: bool) -> list[str]:
    """A conversion's --save before anything is read or written: free (absent, or an empty folder under folders),
    or, with `overwrite`, a folder of checkpoints to replace: then the --overwrite-save line to log when the
    conversion is sure to write (non-empty: replace). A --save holding checkpoints without `overwrite` is one
    CheckpointError saying what to do; any other taken --save one ConfigError (`files/staging.check_free`)."""
    held = holds_checkpoints(save)
    if held is None:
        check_free(save, "--save", True, NEW_CHECKPOINT + ("; --overwrite-save replaces only a folder that holds "
                                                            "checkpoints" if overwrite else ""))
        return []
    if not overwrite:
        raise CheckpointError(f"--save {save} holds {held}; this conversion would write over them. Choose another "
                              f"--save, or give --overwrite-save to replace them (nothing was written)")
    aside = save.rstrip(os.sep) + OVERWRITTEN
    if os.path.lexists(aside):
        raise ConfigError(f"{aside} exists: what an --overwrite-save of {save} that did not finish moved aside (the "
                          f"checkpoints {save} held)? Move it away first (nothing was written)")
    return check_fresh_save([("--save", save)], [], overwrite=True)


@contextlib.contextmanager
def _staged_save(save: str, replace: bool, log) -> Iterator[str]:
    """`staged_output` for a conversion's --save; `replace` (`check_save` gave a note): the folder it holds is
    moved to <save>.overwritten/ for the write, removed once the new checkpoint is in place, moved back if the
    write fails (a killed run leaves it there: nothing of it is lost)."""
    aside = save.rstrip(os.sep) + OVERWRITTEN
    if replace:
        os.rename(save, aside)
    try:
        with staged_output(save, "--save", True, NEW_CHECKPOINT, log) as where:
            yield where
    except BaseException:
        if replace and not os.path.lexists(save):
            os.rename(aside, save)
        raise
    if replace:
        shutil.rmtree(aside)
        log(f"> --overwrite-save: the checkpoints {save} held are replaced (removed {aside})")


def _import(src: str, save: str, tp_size: int, subfolder: Optional[str], parameterization: Optional[str],
            num_heads: Optional[int], log, overwrite: bool = False) -> dict:
    _ensure_world()
    family = source_family(src, subfolder)
    source = family.open_source(src, subfolder, parameterization, num_heads)
    spec = source.spec
    family.check_tp(spec, tp_size, src)
    notes = check_save(save, overwrite)
    for note in notes:
        log(note)
    state = source.read(log)
    with _staged_save(save, bool(notes), log) as where:
        for name, content in source.files(save).items():
            if isinstance(content, str):
                shutil.copyfile(content, os.path.join(where, name))
            else:
                atomic_write(os.path.join(where, name), lambda f, c=content: json.dump(c, f, indent=1), text=True)
        _write_converted(where, save, state, _meta_model(family, spec), tp_size, ModelSize(family, spec).family_name,
                         src, family.data_info(spec))
    final = iter_dir(save, 0)
    log(f"> wrote {final} at TP={tp_size} ({tp_size} file{'s' if tp_size > 1 else ''}) and {save}/config.json")
    return {"spec": spec, "parameters": sum(t.numel() for t in state.values()), "dir": final}


def _write_converted(where: str, save: str, state: dict, meta: FamilyModel, tp_size: int, family: str, src: str,
                     data_info: Optional[dict]) -> str:
    """Our teacher checkpoint at TP=tp_size from a full TP=1 state dict (the split of each parameter from the meta
    model), written at `where` (the staged --save); `--model-size <save>` builds it from the config files the
    family's source wrote beside it."""
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


def _read_ours(root: str, flag: str, merge: bool = True) -> dict:
    """The TP=1 payload of one of our checkpoints; a LoRA role's adapters merged into their base unless not
    `merge` (`train/lora_checkpoint.merged_payload`)."""
    payload = load_payload(root, _one_process(), flag=flag)  # every TP shard joined into TP=1
    if payload is None:
        raise CheckpointError(f"{flag} {root} holds no checkpoint (no {TRACKER})")
    return merged_payload(payload, _one_process(), f"{flag} {root}") if merge else payload


def merge_lora_checkpoint(load: str, save: str, log=print, overwrite: bool = False) -> dict:
    """--merge-lora: a LoRA student (`train/lora_checkpoint.py`) -> a full-weight student checkpoint at TP=1 in
    `save` (its adapters, and its EMA's, merged into the base it names; no optimizer state: it samples, exports
    and initialises a run, and resumes only with --no-load-optim). Returns {"iteration", "dir", "base"}.
    `overwrite` (--overwrite-save): replace the checkpoints `save` holds, unless they are the adapters' base."""
    notes = check_save(save, overwrite)
    raw = _read_ours(load, "--load", merge=False)
    if "lora" not in raw:
        raise ConfigError(f"--merge-lora: --load {load} holds full weights, not LoRA adapters: nothing to merge")
    if notes and os.path.realpath(save) == os.path.realpath(raw["lora"]["base"]):
        raise ConfigError(f"--overwrite-save: --save {save} is the base of --load {load}'s adapters; replacing it "
                          f"would leave them without their base. Choose another --save (nothing was written)")
    payload = merged_payload(raw, _one_process(), f"--load {load}")
    meta = payload.pop("lora_merged")
    for key in ("optimizer", "scheduler", "saved_tp_size"):
        payload.pop(key, None)
    args = copy.deepcopy(payload.get("args", {}))  # the merged role is full weights now
    args.setdefault("lora", {})[f"{payload.get('role', 'student')}_rank"] = 0
    payload.update(args=args, tp_size=1, merged_lora=meta)
    n = int(payload["iteration"])
    for note in notes:
        log(note)
    with _staged_save(save, bool(notes), log) as where:
        save_offline(where, n, [payload])
    log(f"> merged the rank-{meta['rank']} adapters of {load} into their base {meta['base']}: full weights in "
        f"{iter_dir(save, n)} (TP=1)")
    return {"iteration": n, "dir": iter_dir(save, n), "base": meta["base"]}


def _export(layout: str, load: str, out: str, ema: bool, log, allow_bidirectional: bool = False) -> dict:
    """`layout` "diffusers-lora" reads a LoRA student's adapters as they are; every other, full weights (merged,
    once the checks on the raw payload have passed)."""
    raw = _read_ours(load, "--load", merge=False)
    size = checkpoint_spec(load, raw)
    flag = EXPORT_FLAGS[layout]
    if layout == "diffusers-lora" and "lora" not in raw:
        raise CheckpointError(f"--lora-only: --load {load} holds full weights, not LoRA adapters (export it "
                              f"without --lora-only)")
    if layout not in size.family.export_layouts:
        writers = " / ".join(f.title for f in FAMILIES if layout in f.export_layouts)
        if layout == "diffusers-lora":
            raise ConfigError(f"--lora-only: --load {load} holds a {size.family.title} model; a diffusers LoRA file "
                              f"is written for a {writers} model only (--merge-lora --save DIR merges its adapters "
                              f"into full weights)")
        raise ConfigError(f"--load {load} holds a {size.family.title} model, which has no {layout} layout; {flag} "
                          f"exports a {writers} model")
    causal = saved_causal(raw)
    if causal is not None and not allow_bidirectional:
        raise ConfigError(f"--load {load} is a causal student ({causal_words(causal)}); diffusers has no causal "
                          f"mode and would run a {flag} export with full attention over the whole clip, not as it "
                          f"was trained. Sample it chunk by chunk with launch/sample.py --load {load} --stream --out "
                          f"DIR, or give --allow-bidirectional-export to export it anyway (its chunking recorded, "
                          f"the README saying how diffusers runs it)")
    if causal is not None:
        log(f"> --allow-bidirectional-export: --load {load} is a causal student ({causal_words(causal)}); {flag} "
            f"{out} records that, but diffusers runs it with full attention, not as it was trained")
    payload = raw if layout == "diffusers-lora" else merged_payload(raw, _one_process(), f"--load {load}")
    return size.family.export(layout, load, out, payload, size.spec, ema, log)


def export_diffusers(load: str, out: str, ema: bool = True, log=print, allow_bidirectional: bool = False) -> dict:
    """Export to the family's diffusers folder (module docstring); returns {"weights": "ema" | "model", "sigmas":
    [...] or None, "iteration"}. `allow_bidirectional` (--allow-bidirectional-export): a causal student too."""
    check_free(out, "--to-diffusers", True, NEW_FOLDER)
    return _export("diffusers", load, out, ema, log, allow_bidirectional)


def export_diffusers_lora(load: str, out: str, ema: bool = True, log=print, allow_bidirectional: bool = False) -> dict:
    """--to-diffusers --lora-only: a LoRA student's adapters as the family's diffusers LoRA file (Wan:
    `WanPipeline.load_lora_weights`; `models/wan/export.export_lora`)."""
    check_free(out, "--to-diffusers", True, NEW_FOLDER)
    return _export("diffusers-lora", load, out, ema, log, allow_bidirectional)


def export_official(load: str, out: str, ema: bool = True, log=print, allow_bidirectional: bool = False) -> dict:
    """Export to the family's official file (a DiT imported from the official SiT / DiT layout -> an official .pt
    state dict; learn_sigma=False: the variance channels were dropped on import)."""
    check_free(out, "--to-official", False, NEW_FILE)
    return _export("official", load, out, ema, log, allow_bidirectional)


def _ensure_world() -> None:
    """megatron-core's linears need its parallel state even at TP=1: a world of one if none exists."""
    if not dist.is_initialized():
        init_distributed(ParallelConfig())


def load_model(path: str, ema: bool = True, parameterization: Optional[str] = None,
               num_heads: Optional[int] = None) -> FamilyModel:
    """A public folder, an official file (an official SiT / DiT .pt: give its `parameterization`, sit or vp-eps)
    or one of our checkpoints -> TP=1 fp32 CPU model in eval mode (module docstring)."""
    _ensure_world()
    if os.path.isfile(os.path.join(path, TRACKER)):
        payload = _read_ours(path, "load_model")
        size = checkpoint_spec(path, payload)
        family, spec = size.family, size.spec
        info, causal = payload.get("data_info"), ModelConfig.saved(payload.get("args")).causal_layout()
        model = family.build(spec, family.default_shape(spec) if info is None else DataShape.from_info(info), 1,
                             BuildOptions(causal=causal))  # a causal student streams: `stream_forward`
        state = {**payload["model"], **payload["ema"]} if ema and "ema" in payload else payload["model"]
        load_model_weights(model, state, path)
        return model.float().eval()
    family = source_family(path, None, "load_model")
    source = family.open_source(path, None, parameterization, num_heads)
    model = family.build(source.spec, family.default_shape(source.spec), 1)
    state = source.read(lambda *_: None)
    load_model_weights(model, {**state, **_extra_states(model)}, path)
    return model.float().eval()
