"""The model-family interface: what DMD2, sampling, checkpoints and the planner may ask of a model.

A family (the DiT and the Wan today) is a module of `dmd2_mega/models/` that provides a `ModelFamily`: a name and
`build(spec, shape, tp_size, options) -> FamilyModel`, which builds the model at a TP size from a
named spec (`registry.MODEL_SIZES` maps each `--model-size` to its family and spec). Every model is
a `FamilyModel`:

    forward(x [B, *shape], sigma [B] fp32, cond) -> v [B, *shape]
        velocity in DESIGN section 1's convention: x_s = (1 - s) x0 + s eps, v = eps - x0; the
        timestep s * 1000 is the model's business. cond: labels [B] int64 or embeddings [B, ...].
    features(x, sigma, cond, layer) -> [B, feature_dim]
        token mean of block `layer`'s output (0 <= layer < num_feature_layers; the blocks after it
        are not run): what DMD2's GAN head reads.
    null_cond(n, device) -> [n, ...]
        the negative / null condition of classifier-free guidance: the learned null class, or for text the
        negative-prompt embedding given by `set_negative` (the data's; zeros until then).
    expert_modules() -> (sub-models of which each forward runs only some) or ()
        Wan 2.2's experts: a time-sliced frozen role wakes only the expert a forward runs.
    tp_split() -> {parameter name: dim it is split along across TP ranks, or None if replicated}
        what checkpoints reshard and the optimizer's gradient norm counts once.

Nothing outside `models/` knows which family it holds.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from dmd2_mega.errors import ConfigError
from dmd2_mega.models import linears
from dmd2_mega.models.attention import check_backend
from dmd2_mega.distributed.parallel import tp_partition_dim


@dataclass(frozen=True)
class DataShape:
    """What a model is built for: sample shape [in_channels, *spatial] and condition kind (exactly one of the
    two last)."""

    in_channels: int
    spatial: tuple
    """(H, W) for images, (T, H, W) for video latents; an int n means (n, n)."""
    num_classes: Optional[int] = None
    """Labels in [0, num_classes); the model adds a learned null class."""
    cond_shape: Optional[tuple] = None
    """Per-sample embedding shape [D] or [L, D]; the null condition is zeros (or the data's negative prompt)."""

    def __post_init__(self):
        if isinstance(self.spatial, int):  # a square image of that side
            object.__setattr__(self, "spatial", (self.spatial, self.spatial))
        object.__setattr__(self, "spatial", tuple(int(n) for n in self.spatial))

    @property
    def sample_shape(self) -> tuple:
        return (self.in_channels, *self.spatial)

    @classmethod
    def from_info(cls, info: dict) -> "DataShape":
        """From the `data_info` dict that checkpoints store (`latent_shape` [C, *spatial]; checkpoints written
        before video data record square images as `image_size`)."""
        cond = info.get("cond_shape")
        shape = info.get("latent_shape") or (info["in_channels"], info["image_size"], info["image_size"])
        return cls(int(shape[0]), tuple(int(n) for n in shape[1:]), info.get("num_classes"),
                   tuple(cond) if cond is not None else None)


def check_build(name: str, num_heads: int, tp_size: int, options: "BuildOptions") -> None:
    """What every family's constructor checks first: the attention backend and linear implementation asked for
    are installed (a clear error, never a silent fallback) and TP divides the heads of --model-size `name`."""
    check_backend(options.attention_backend)
    if options.sequence_parallel and options.transformer_impl != "local":
        raise ConfigError("--sequence-parallel runs with --transformer-impl local (transformer-engine's "
                          "sequence-first layout [s, b, h] is not the token layout [b, s, h] of our models)")
    if options.transformer_impl == "transformer_engine":
        linears.require_transformer_engine()
    if num_heads % tp_size:
        raise ConfigError(f"--tensor-model-parallel-size {tp_size} must divide the number of attention heads "
                          f"({num_heads}) of --model-size {name}")
    if num_heads % (tp_size * options.context_parallel):
        raise ConfigError(f"--tensor-model-parallel-size {tp_size} x --context-parallel-size "
                          f"{options.context_parallel} must divide the number of attention heads ({num_heads}) of "
                          f"--model-size {name} (Ulysses gives each CP rank a share of TP's heads)")


@dataclass(frozen=True)
class BuildOptions:
    """Implementation choices that do not change the weights (validated in `config.ModelConfig`)."""

    attention_backend: str = "sdpa"
    transformer_impl: str = "local"
    recompute: bool = False
    """Recompute each block in backward (activation checkpointing) while training."""
    context_parallel: int = 1
    """CP ranks that split the token sequence (`models/token_parallel.py`); the run's --context-parallel-size."""
    sequence_parallel: bool = False
    """Shard the token sequence over the TP group between the matmuls (--sequence-parallel)."""


class FamilyModel(nn.Module, metaclass=abc.ABCMeta):
    """Abstract base of every family's model (see the module docstring): a family that leaves out one of
    the abstract methods cannot be instantiated."""

    spec: object
    options: BuildOptions = BuildOptions()
    """How it was built: a wrapper of the model (the GAN critic) reads the context-parallel size here."""
    num_feature_layers: int
    feature_dim: int

    @abc.abstractmethod
    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Velocity v [B, *shape] (module docstring)."""

    @abc.abstractmethod
    def features(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor, layer: int) -> torch.Tensor:
        """Token mean of block `layer`'s output [B, feature_dim]."""

    @abc.abstractmethod
    def null_cond(self, n: int, device) -> torch.Tensor:
        """The negative / null condition of n samples."""

    def set_negative(self, emb: torch.Tensor) -> None:
        """CFG's negative condition for text models: the data's negative-prompt embedding [*cond_shape] (held in
        the `negative` buffer that `null_cond` expands; zeros until set)."""
        neg = getattr(self, "negative", None)
        if neg is None:
            raise ConfigError("a class-conditional model has a learned null class, not a negative-prompt embedding")
        if tuple(emb.shape) != tuple(neg.shape):
            raise ConfigError(f"the negative-prompt embedding has shape {list(emb.shape)}, but the model takes text "
                              f"embeddings {list(neg.shape)}")
        neg.copy_(emb)

    def expert_modules(self) -> tuple:
        """Sub-models of which each forward runs only some (Wan 2.2's two experts), else (): a frozen role keeps
        only the running one resident when it is time-sliced (`offload.ExpertSleeper`)."""
        return ()

    def tp_split(self) -> dict:
        return {name: tp_partition_dim(p) for name, p in self.named_parameters()}


@dataclass(frozen=True)
class ModelFamily:
    name: str
    build: Callable[..., FamilyModel]
    """build(spec, shape: DataShape, tp_size: int, options: BuildOptions) -> FamilyModel on the CPU."""


def count_parameters(model: nn.Module, tp_group=None, device: Optional[torch.device] = None) -> int:
    """Parameters of the whole (TP=1-equivalent) model: TP shards summed, replicas counted once.
    The TP all-reduce runs on `device` (the run's compute device: NCCL takes no host tensors)."""
    sharded = sum(p.numel() for p in model.parameters() if tp_partition_dim(p) is not None)
    replicated = sum(p.numel() for p in model.parameters() if tp_partition_dim(p) is None)
    if dist.is_initialized() and tp_group is not None and dist.get_world_size(tp_group) > 1:
        dev = device if device is not None else next(model.parameters()).device
        t = torch.tensor([sharded], dtype=torch.int64, device=dev)
        dist.all_reduce(t, group=tp_group)
        sharded = int(t.item())
    return sharded + replicated
