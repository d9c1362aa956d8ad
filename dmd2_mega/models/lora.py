"""Low-rank adapters (LoRA) on the tensor-parallel linears of `models/linears.py`, exact under TP, SP and CP.

A linear y = x W^T + b (in -> out features) with an adapter computes y + s (x A^T) B^T, s = alpha / r, with
A [r, in] and B [out, r] (PEFT's LoRA). B starts at zero, so an adapted model starts as its base exactly. A starts
as PEFT initialises it by default, kaiming_uniform_(a=sqrt(5)), that is U(-1/sqrt(in), 1/sqrt(in)). It is drawn as
the whole TP = 1 matrix from a generator seeded per adapter and then sliced, so every TP size starts from the same
adapters.

The adapter is laid out like its base:
    column-parallel base (W [out/TP, in], the input whole on every rank)
        A [r, in] replicated, B [out/TP, r] split along dim 0. The input's gradient through the adapter joins the
        base's in the one all-reduce the column linear already does. A rank's gradient of A is the part from its
        rows of B: it is summed over TP by the gradient buffer, with no collective in the forward or backward pass
        (A is tagged `tp_partial_grad`, as sequence-parallel LayerNorms are).
    row-parallel base (W [out, in/TP], the input split)
        A [r, in/TP] split along dim 1, B [out, r] replicated. The adapter's output on a rank is a partial sum that
        is added to the base's before the base's all-reduce (or, under SP, its reduce-scatter): no extra
        collective. B's gradient is a part, summed over TP by the gradient buffer (tagged as above).
Under SP the column adapters' A rides in the base's gathered-input linear (`token_parallel.sp_linears`); under CP
every rank holds whole adapters, like its base.

`attach_lora(model, targets, rank, alpha, seed)` gives the linears named in `targets` (a family's names:
`ModelFamily.lora_targets`) an adapter each; the base weights stay as they are.
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from torch import nn

from dmd2_mega.errors import ConfigError


class LoRA(nn.Module):
    """The adapter of one linear (module docstring): `down(x)` = x A^T on this rank's slice of the input, `up(h)` =
    s h B^T; `delta(x)` = up(down(x))."""

    def __init__(self, kind: str, in_features: int, out_features: int, rank: int, alpha: float,
                 generator: torch.Generator):
        super().__init__()
        if kind not in ("column", "row"):
            raise ValueError(f"a LoRA adapts a column or row parallel linear, got {kind!r}")
        if rank < 1:
            raise ConfigError(f"a LoRA rank must be >= 1, got {rank}")
        tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
        split = out_features if kind == "column" else in_features
        if split % tp:
            raise ConfigError(f"a LoRA on a {kind} parallel linear of {in_features} -> {out_features} features "
                              f"cannot be split over TP = {tp}")
        self.kind, self.rank, self.scale = kind, rank, alpha / rank
        bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on [r, in]: gain sqrt(1/3), sqrt(3/in)
        a = torch.empty(rank, in_features).uniform_(-bound, bound, generator=generator)
        b = torch.zeros(out_features, rank)
        if kind == "column":
            b = b.chunk(tp, 0)[tp_rank]
        else:
            a = a.chunk(tp, 1)[tp_rank]
        self.A, self.B = nn.Parameter(a.contiguous()), nn.Parameter(b.contiguous())
        split_param, whole_param, dim = (self.B, self.A, 0) if kind == "column" else (self.A, self.B, 1)
        split_param.tensor_model_parallel, split_param.partition_dim, split_param.partition_stride = True, dim, 1
        whole_param.tp_partial_grad = True  # each TP rank's gradient is a part (module docstring)

    def down(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.A.to(x.dtype))

    def up(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.B.to(h.dtype)) * self.scale

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))

    def extra_repr(self) -> str:
        return f"{self.kind}, rank={self.rank}, scale={self.scale:g}"


def attach_lora(model: nn.Module, targets: tuple, rank: int, alpha: float, seed: int) -> list[str]:
    """Give every linear of `model` whose attribute name is in `targets` an adapter (module docstring); returns the
    adapted modules' names. Each adapter's A comes from a generator seeded by (seed, its name), so the draws do not
    depend on the order of the modules or on TP."""
    from dmd2_mega.models.linears import AdaptableLinear
    names = []
    for name, module in model.named_modules():
        if isinstance(module, AdaptableLinear) and name.rsplit(".", 1)[-1] in targets:
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            module.attach(LoRA(module.kind, module.in_features, module.out_features, rank, alpha, g))
            names.append(name)
    if not names:
        raise ConfigError(f"no linear of the model is named like a LoRA target of {sorted(targets)}")
    return names


def share_base(model: nn.Module, base: nn.Module) -> None:
    """Make every parameter of `model` the same tensor as `base`'s of the same name (a LoRA role over the teacher's
    weights: one copy of the base, `adapt`). The two must have the same parameter names and shapes (the same family
    and size; a causal Wan and its bidirectional teacher do)."""
    mine, theirs = dict(model.named_parameters()), dict(base.named_parameters())
    if mine.keys() != theirs.keys() or any(mine[k].shape != theirs[k].shape for k in mine):
        raise ConfigError("a LoRA role shares the teacher's weights only when both are the same model: give the "
                          "role its own copy (--no-lora-shared-base) or the teacher's --model-size")
    for name, p in theirs.items():
        path, _, attr = name.rpartition(".")
        setattr(model.get_submodule(path) if path else model, attr, p)


def adapt(model: nn.Module, targets: tuple, rank: int, alpha: float, seed: int, base: nn.Module = None) -> list:
    """A LoRA role (module docstring) from `model` holding its init weights: shares `base`'s weights when given
    (`share_base`), freezes every weight of its family model and attaches adapters on `targets`, the only trainable
    parameters the family model then has. A method's wrapper around the family model (DMD2's GAN critic: its
    `trunk`) keeps its own parameters (the GAN head) trainable. Returns the adapted linears."""
    from dmd2_mega.models.family import FamilyModel
    trunk = model
    while True:  # the innermost family model: a wrapper's trunk
        inner = [m for n, m in trunk.named_children() if isinstance(m, FamilyModel)]
        if len(inner) != 1:
            break
        trunk = inner[0]
    if base is not None:
        share_base(trunk, base)
    trunk.requires_grad_(False)
    device = next(trunk.parameters()).device
    names = attach_lora(trunk, targets, rank, alpha, seed)
    for m in trunk.modules():
        if isinstance(m, LoRA):
            m.to(device)
    return [trunk.get_submodule(n) for n in names]


def merge_lora(base: dict, adapters: dict, scale: float) -> dict:
    """A full-weight state dict: `base` (a model's state dict, any TP shard) with each adapted linear's weight
    W + scale B A, from `adapters` ({`<linear>.lora.A` / `.lora.B`: tensor} of the same TP degree, and any other
    trained tensor, e.g. a GAN head, taken as it is). Shard-wise exact: a column base's B and W rows are split
    alike (A whole); a row base's A and W columns are (B whole)."""
    out = dict(base)
    for key, value in adapters.items():
        if key.endswith(".lora.B"):
            continue
        if not key.endswith(".lora.A"):
            out[key] = value
            continue
        prefix = key[:-len(".lora.A")]
        w = base.get(prefix + ".inner.weight")
        b = adapters.get(prefix + ".lora.B")
        if w is None or b is None:
            raise KeyError(f"the adapter {prefix} has no {'base weight' if w is None else 'B'} to merge with")
        out[prefix + ".inner.weight"] = (w.float() + scale * b.float() @ value.float()).to(w.dtype)
    return out


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapters' parameters (A, B of every `LoRA`), in module order."""
    return [p for m in model.modules() if isinstance(m, LoRA) for p in (m.A, m.B)]
