"""Checkpoints of LoRA roles (`models/lora.py`): the adapters, and where their base is.

A LoRA role's payload holds, in `model`, only its trained tensors (the adapters' A and B, and a critic's GAN head)
and, in `lora`, what the base is:
    {"rank": r, "alpha": a, "scale": a / r, "targets": [...], "base": the absolute path of the checkpoint whose
     weights are the base (the teacher's, or the role's --<role>-load), "fingerprint": `state_fingerprint` of
     that checkpoint's weights}
A resume checks the fingerprint against this run's base (a different base is a one-line error unless
--lora-allow-other-base) and loads the adapters only. A reader of the student's weights (`launch/sample.py`,
`pretrained.load_model`, the exports) gets the merged full weights from `merged_payload`: the base read from
its path (resharded to the reader's TP like any checkpoint) with W + s B A on each adapted linear; a base that is
itself a LoRA run (a LoRA role initialised from a LoRA checkpoint, merged on load) is merged first, the same way.

The fingerprint is a digest of, per tensor of the base's state dict (in name order), its name, shape, float64
sum and sum of squares, the sums of a TP-split tensor all-reduced over the TP group and rounded to 9 significant
digits: the same for every TP degree the base is read at, different for other weights.
"""
from __future__ import annotations

import hashlib
import os

import torch
import torch.distributed as dist

from dmd2_mega.errors import CheckpointError
from dmd2_mega.models.lora import merge_lora


def state_fingerprint(state: dict, dims: dict, ps) -> str:
    """The base's fingerprint (module docstring) from this rank's `state` and the partition `dims` of its keys."""
    keys = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point())
    if not keys:
        return "empty"
    sums = torch.stack([torch.stack([state[k].double().sum(), state[k].double().square().sum()]) for k in keys])
    split = torch.tensor([dims.get(k) is not None for k in keys])
    if ps.tp_size > 1 and bool(split.any()):
        part = torch.where(split[:, None].to(sums.device), sums, torch.zeros_like(sums))
        dist.all_reduce(part, group=ps.tp_group)
        sums = torch.where(split[:, None].to(sums.device), part, sums)
    digest = hashlib.sha256()
    for k, (total, squares) in zip(keys, sums.cpu().tolist()):
        shape = list(state[k].shape)
        if dims.get(k) is not None:
            shape[dims[k]] *= ps.tp_size
        digest.update(f"{k}:{shape}:{total:.9e}:{squares:.9e};".encode())
    return digest.hexdigest()[:16]


def adapter_payload(payload: dict, model: torch.nn.Module, meta: dict) -> dict:
    """A LoRA role's payload from its full training payload: `model` cut to the trained tensors, `lora` = meta."""
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    return {**payload, "model": {k: v for k, v in payload["model"].items() if k in trained}, "lora": meta}


def check_base(saved: dict, now: dict, source: str, allow_other: bool) -> None:
    """CheckpointError when the adapters in `source` were trained over another base than this run's (by
    fingerprint), unless --lora-allow-other-base; a different rank / alpha / targets is always an error."""
    for key, flag in (("rank", "the rank"), ("alpha", "--lora-alpha"), ("targets", "--lora-target-modules")):
        if saved.get(key) != now.get(key):
            raise CheckpointError(f"{source} holds LoRA adapters with {flag} {saved.get(key)}, this run has "
                                  f"{now.get(key)}")
    if saved["fingerprint"] != now["fingerprint"] and not allow_other:
        raise CheckpointError(f"{source} holds LoRA adapters trained over the base {saved['base']} (fingerprint "
                              f"{saved['fingerprint']}), but this run's base {now['base']} is other weights "
                              f"(fingerprint {now['fingerprint']}); pass --lora-allow-other-base to load them anyway")


def merged_payload(payload: dict, ps, source: str) -> dict:
    """`payload` itself, or for a LoRA role's payload the same with full weights (module docstring): `model` (and
    `ema`, the student's averaged adapters) merged into the base read from its path at `ps`'s TP degree."""
    meta = payload.get("lora")
    if meta is None:
        return payload
    from dmd2_mega.train.checkpoint import load_payload
    base_path = meta["base"]
    if not os.path.isdir(base_path):
        raise CheckpointError(f"{source} holds LoRA adapters over the base {base_path}, which is not a directory "
                              f"(moved? the base must stay where it was trained, or merge the adapters first)")
    base = load_payload(base_path, ps, flag=f"{source}'s LoRA base")
    if base is None:
        raise CheckpointError(f"{source} holds LoRA adapters over the base {base_path}, which holds no checkpoint")
    base = merged_payload(base, ps, f"{source}'s LoRA base {base_path}")  # a base that is itself a LoRA run's
    found = state_fingerprint(base["model"], base.get("partition_dims", {}), ps)
    if found != meta["fingerprint"]:
        raise CheckpointError(f"{source} holds LoRA adapters trained over {base_path} with fingerprint "
                              f"{meta['fingerprint']}, but its weights now have fingerprint {found}: was it "
                              f"overwritten? (merge the adapters against the right base)")
    out = {k: v for k, v in payload.items() if k != "lora"}
    out["model"] = merge_lora(base["model"], payload["model"], meta["scale"])
    if "ema" in payload:
        out["ema"] = merge_lora(base["model"], {**payload["model"], **payload["ema"]}, meta["scale"])
    out["partition_dims"] = {**base.get("partition_dims", {}),
                             **{k: v for k, v in payload.get("partition_dims", {}).items() if ".lora." not in k}}
    out["lora_merged"] = meta
    return out
