"""The model-family contract: everything the rest of the package may ask of a family and of its models.

A family (the DiT: `models/dit/`, the Wan: `models/wan/`) is a sub-package of `dmd2_mega/models/` that provides
one `ModelFamily` (torchtitan's `TrainSpec`): building its model at a TP size from a spec; recognising a
`--model-size` config.json, a public folder or an official file and the spec it describes; its public layouts
both ways (reading a source into our TP=1 state dict, the config files beside a converted checkpoint, the export
writers); its planner maths (`PlanMaths`: parameters, FLOPs, activations, under TP / CP / SP); the data shape and
condition kind it takes; which parallel layouts it supports. `registry.py` lists the families (`FAMILIES`) and
finds the one that recognises a path or owns a spec; nothing outside `models/` imports a family's modules or
names a family (`.importlinter`, contract "only dmd2_mega.models imports a family's modules"). `name` is the tag
stored in checkpoint payloads ("family"), compared only for identity (`train/checkpoint_guard.check_family`).

Every model is a `FamilyModel`:

    forward(x [B, *shape], sigma [B] fp32, cond) -> v [B, *shape]
        velocity in DESIGN section 1's convention: x_s = (1 - s) x0 + s eps, v = eps - x0; the
        timestep s * 1000 is the model's business. cond: labels [B] int64 or embeddings [B, ...].
    features(x, sigma, cond, layer) -> [B, feature_dim, *feature_grid]
        block `layer`'s output as its token grid, channels first (0 <= layer < num_feature_layers; the blocks
        after it are not run), every token on every TP / SP / CP rank (gathered; the backward keeps each
        rank's part): what DMD2's GAN head classifies. `feature_grid` is the grid of the data's shape: (H, W)
        patches of an image model, (F, H, W) of a video model.
    forward_features(x, sigma, cond, layer) -> (v, features)
        both from one forward: the velocity and block `layer`'s token grid on the way (equal to `forward`
        and `features`): the GAN head reads the critic's own flow-matching forward at no extra cost.
    forward_features_and(x, sigma, cond, layer, extra=(x', sigma', cond')) -> (v, features, features of x')
        the same with rows that need only the features (the head's real samples): by default `forward_features`
        and `features`; the DiT and the Wan run x' in x's batch up to block `layer` and drop it there (one pass,
        larger matmuls; equal up to their rounding).
    null_cond(n, device) -> [n, ...]
        the negative / null condition of classifier-free guidance: the learned null class, or for text the
        negative-prompt embedding given by `set_negative` (the data's; zeros until then).
    negative_for(cond) -> [B, ...]
        CFG's negative of these samples, what every sampler and score calls: `null_cond`, or for a condition
        with parts the negative keeps (an image-to-video Wan's image) the sample's own with its text swapped.
    pin_given(x0, cond) -> x0
        a generated sample with what its condition fixes put back (a first-frame image-to-video Wan's first
        latent frame is the given image's, as WanImageToVideoPipeline returns it); x0 itself for other models.
    expert_modules() -> (sub-models of which each forward runs only some) or ()
        Wan 2.2's experts: a time-sliced frozen role wakes only the expert a forward runs.
    tp_split() -> {parameter name: dim it is split along across TP ranks, or None if replicated}
        what checkpoints reshard and the optimizer's gradient norm counts once.

Nothing outside `models/` knows which family it holds.
"""
from __future__ import annotations

import abc
import functools
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from dmd2_mega.errors import CheckpointError, ConfigError
from dmd2_mega.models import compiled, linears, recompute
from dmd2_mega.models.attention import check_backend
from dmd2_mega.models.causal import CausalLayout
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
    """Per-sample embedding shape [D] or [L, D]; the null condition is zeros (or the data's negative prompt). With
    `cond_parts`, the flat [N] of the parts."""
    cond_parts: Optional[tuple] = None
    """A condition of several parts, flattened and concatenated in this order: ((name, shape), ...), e.g. an
    image-to-video Wan's text, CLIP embedding and image latent (`models/wan/image.py`); None: cond_shape as it is."""

    def __post_init__(self):
        if isinstance(self.spatial, int):  # a square image of that side
            object.__setattr__(self, "spatial", (self.spatial, self.spatial))
        object.__setattr__(self, "spatial", tuple(int(n) for n in self.spatial))
        if self.cond_parts is not None:
            parts = tuple((str(name), tuple(int(n) for n in shape)) for name, shape in self.cond_parts)
            object.__setattr__(self, "cond_parts", parts)
            object.__setattr__(self, "cond_shape", (sum(math.prod(shape) for _, shape in parts),))

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
                   tuple(cond) if cond is not None else None, info.get("cond_parts"))


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
    recompute: str = "none"
    """Activation recompute of each block in backward while training (`models/recompute.py`): none, selective
    (attention outputs kept) or full; a bool means full / none."""
    context_parallel: int = 1
    """CP ranks that split the token sequence (`models/token_parallel.py`); the run's --context-parallel-size."""
    sequence_parallel: bool = False
    """Shard the token sequence over the TP group between the matmuls (--sequence-parallel)."""
    causal: Optional[CausalLayout] = None
    """A causal (streaming) student: frames in chunks, block-causal attention (`models/causal.py`; --causal-*
    flags); None: every token sees every token. Only a family with frames builds one."""
    compile: bool = False
    """Each transformer block under torch.compile (`models/compiled.py`; --compile, decided by `compiled.choose`)."""

    def __post_init__(self):
        object.__setattr__(self, "recompute", recompute.granularity(self.recompute))


def joined_rows(inputs: tuple, extra: tuple) -> tuple:
    """(x, sigma, cond) and the rows extra = (x', sigma', cond') as one batch each, x's rows first: the one pass of
    a family's `FamilyModel.forward_features_and`."""
    return tuple(torch.cat(pair) for pair in zip(inputs, extra))


class FamilyModel(nn.Module, metaclass=abc.ABCMeta):
    """Abstract base of every family's model (see the module docstring): a family that leaves out one of
    the abstract methods cannot be instantiated."""

    spec: object
    options: BuildOptions = BuildOptions()
    """How it was built: a wrapper of the model (the GAN critic) reads the context-parallel size here."""
    num_feature_layers: int
    feature_dim: int
    feature_grid: tuple

    @abc.abstractmethod
    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Velocity v [B, *shape] (module docstring)."""

    @abc.abstractmethod
    def features(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor, layer: int) -> torch.Tensor:
        """Block `layer`'s output as its token grid [B, feature_dim, *feature_grid] (module docstring)."""

    @abc.abstractmethod
    def forward_features(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor,
                         layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(v [B, *shape], block `layer`'s token grid [B, feature_dim, *feature_grid]) from one forward."""

    def forward_features_and(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor, layer: int,
                             extra: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(v, features of x, features [B', feature_dim, *feature_grid] of extra = (x', sigma', cond'), rows
        that need only the features): here two passes; a family whose blocks take rows of any batch runs one (module docstring)."""
        v, feats = self.forward_features(x, sigma, cond, layer)
        return v, feats, self.features(*extra, layer)

    @abc.abstractmethod
    def null_cond(self, n: int, device) -> torch.Tensor:
        """The negative / null condition of n samples."""

    def negative_for(self, cond: torch.Tensor) -> torch.Tensor:
        """CFG's negative condition of the samples of `cond`: `null_cond`, unless the condition has parts the
        negative keeps (an image-to-video Wan keeps the image, `models/wan/image.py`)."""
        return self.null_cond(cond.shape[0], cond.device)

    def pin_given(self, x0: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """x0 [B, *shape] with the part its condition fixes put back (module docstring); x0 for most models."""
        return x0

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

    def transformer_blocks(self) -> list:
        """The blocks `--compile` compiles (`models/compiled.py`): `self.blocks`, every layer one class."""
        return list(self.blocks)

    def region(self, name: str) -> Callable:
        """This model's method `name`, compiled when the model was built with --compile (`compiled.function`: a region
        beside the blocks that the family names, e.g. the DiT's embedding and final layer); the method otherwise."""
        if not self.options.compile:
            return getattr(self, name)
        return functools.partial(compiled.function(getattr(type(self), name), type(self).__name__ + name), self)

    causal_layout = None
    """A causal student's `CausalLayout` (`models/causal.py`), None for a model whose tokens all see each other."""

    def stream(self, noise: torch.Tensor, cond: torch.Tensor, denoise: Callable, context_noise: float = 0.0):
        """A causal student generates chunk by chunk (`models/wan/causal.py`); any other model refuses."""
        raise ConfigError(f"{self.spec.name} is not a causal model: streaming generation needs a student trained or "
                          f"initialised with --causal")

    def expert_modules(self) -> tuple:
        """Sub-models of which each forward runs only some (Wan 2.2's two experts), else (): a frozen role keeps
        only the running one resident when it is time-sliced (`offload.ExpertSleeper`)."""
        return ()

    def tp_split(self) -> dict:
        return {name: tp_partition_dim(p) for name, p in self.named_parameters()}


class PlanMaths(NamedTuple):
    """A family's planner formulas (its `plan.py` docstring gives them), each reading a planner shape `ms`
    (`plan/memory_plan.ModelShape`: spec, in_channels, spatial, num_classes, cond_shape, tokens, text_len, mlp):
    param_counts(ms) -> {'sharded', 'replicated', 'tensors', 'buffer'}; forward_flops(ms, n, tp); per block
    layer(ms, n, tp, bf16, cp, sp) kept for backward and block_input(ms, n, bf16, tp, cp, sp) under full recompute;
    attention_kept(ms, n, tp, bf16, cp, sp) per block, what selective recompute keeps beside the block's input, and
    recompute_flops(ms, n, tp, selective) the blocks' forward FLOPs a backward reruns (selective: less the attention
    cores, `models/recompute.py`);
    outside(ms, n, tp, bf16, recompute, cp, sp) kept outside the blocks (recompute: selective or full); nograd(ms, n,
    tp, bf16, cp, sp) the peak of a no-grad forward; scores(ms, n, tp, bf16, cp, sp) per block, what SDPA's math
    path keeps beyond the fused kernels; kv_cache(ms, n, frames, tp, bf16, cp, sp) per layer, a causal student's KV
    cache: (the self-attention k / v of one cached chunk of `frames` token frames, the text's k / v), ConfigError for
    a family or spec with no causal student; lora_linears(ms) -> [(name, "column" | "row", in, out)], every linear
    of every layer that a LoRA adapter may sit on (`ModelFamily.lora_targets`). cp / sp split the tokens; a family
    that does not split tokens is only asked for cp = 1, sp = False."""

    param_counts: Callable
    forward_flops: Callable
    layer: Callable
    block_input: Callable
    outside: Callable
    nograd: Callable
    scores: Callable
    kv_cache: Callable
    lora_linears: Callable
    attention_kept: Callable
    recompute_flops: Callable


class Source(NamedTuple):
    """A public checkpoint a family recognised (`ModelFamily.open_source`)."""

    spec: object
    read: Callable
    """read(log) -> our TP=1 state dict {name: tensor}, every tensor checked against the model the spec builds;
    it logs one line of what it reads."""
    files: Callable
    """files(save) -> {file name: a JSON dict, or a path to copy}: written beside a checkpoint converted into
    `save`, so that `--model-size <save>` builds the spec again (`ModelFamily.recognise`)."""


class ModelFamily(abc.ABC):
    """The whole contract of a family (module docstring). One instance per family, listed in
    `registry.FAMILIES`; the sizes it registers are in `registry.MODEL_SIZES`."""

    name: str
    """The tag checkpoints record (payload "family", `our_config`); stays as it is so old checkpoints load."""
    title: str
    """How messages name it ("DiT", "Wan")."""
    reads: str
    """What it recognises, in words: the one-line error for a path no family reads lists each family's."""
    spec_type: type
    """Its spec dataclass: `registry.family_of(spec)` finds the family of a spec by it."""
    splits_tokens: bool = False
    """Supported layouts: every family takes TP x DP; a family that splits tokens also takes CP (Ulysses) and
    Megatron sequence parallelism (`models/token_parallel.py`)."""
    export_layouts: tuple = ()
    """The public layouts `export` writes: "diffusers" (a folder), "official" (a file)."""
    lora_targets: tuple = ()
    """The names of its linears that LoRA adapters may sit on (`models/lora.py`; --lora-target-modules), each
    the attribute name of an `linears.AdaptableLinear` in its blocks; () for a family without adapters."""

    def __repr__(self) -> str:
        return f"<model family {self.name}>"

    # ---- building
    @abc.abstractmethod
    def build(self, spec, shape: DataShape, tp_size: int = 1, options: BuildOptions = BuildOptions()) -> FamilyModel:
        """The model of `spec` for `shape` at TP degree `tp_size`, on the CPU (or the meta device)."""

    @abc.abstractmethod
    def default_shape(self, spec) -> DataShape:
        """The shape to build `spec` with when no data gives one (a converted checkpoint, a meta model)."""

    # ---- recognising
    @abc.abstractmethod
    def recognise(self, config_path: str, folder: str, name: str):
        """The spec of `--model-size name` whose config file is `config_path` (`folder`: the folder named, which
        may say more, e.g. two experts), or None when the file is not this family's."""

    @abc.abstractmethod
    def reads_source(self, src: str, subfolder: Optional[str] = None) -> bool:
        """Whether `src` (a public folder, a pipeline folder, an official file) is this family's to import."""

    @abc.abstractmethod
    def open_source(self, src: str, subfolder: Optional[str] = None, parameterization: Optional[str] = None,
                    num_heads: Optional[int] = None) -> Source:
        """The spec of a source this family reads and its reader (`Source`); ConfigError for options it does not
        take (`parameterization`, `num_heads`: what an official file cannot tell)."""

    # ---- converted checkpoints and exports
    @abc.abstractmethod
    def check_tp(self, spec, tp_size: int, where: str) -> None:
        """ConfigError unless `tp_size` divides what TP splits (a conversion checks it before writing)."""

    def data_info(self, spec) -> Optional[dict]:
        """The data_info a converted checkpoint records (what it was trained on), or None (not recorded)."""
        return None

    @abc.abstractmethod
    def export(self, layout: str, load: str, out: str, payload: dict, spec, ema: bool, log) -> dict:
        """Write the weights of one of our checkpoints (`payload`, joined to TP=1) in public `layout` at `out`
        (checked free by the caller), all or nothing; {"weights": "ema" | "model", "sigmas", "iteration"}."""

    # ---- data and the planner
    @abc.abstractmethod
    def plan_data(self, spec, name: str, *, latent_shape, in_channels: int, image_size: int,
                  num_classes: Optional[int], cond_shape, text_len: Optional[int]) -> DataShape:
        """The data shape launch/plan_memory.py's flags describe for this family (its sample layout and condition
        kind); ConfigError naming a flag it does not take."""

    @abc.abstractmethod
    def plan_spec(self, spec, name: str, shape: DataShape, patch: Optional[int]):
        """The spec the planner sizes for data `shape` (with `--patch` where the family takes one); ConfigError for a
        shape the model cannot take."""

    plan: PlanMaths
    """The planner's formulas (`PlanMaths`)."""

    @abc.abstractmethod
    def mlp_width(self, spec) -> int:
        """The MLP / FFN width TP must divide."""

    def experts(self, spec) -> int:
        """Sub-models of which a forward runs one (a time-sliced frozen role holds one at a time); 0: one model."""
        return 0

    @abc.abstractmethod
    def describe(self, name: str, spec, latents: str, tokens: int, text_len: int) -> str:
        """The planner's one-line description of `--model-size name` on latents `latents` (launch/plan_memory.py)."""


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


def expected_shapes(model: nn.Module) -> dict:
    """{parameter name: shape} of a model (built on the meta device: no memory)."""
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def check_state(state: dict, expected: dict, where: str) -> None:
    """CheckpointError naming `where` unless `state` holds exactly the tensors of `expected` ({name: shape})."""
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise CheckpointError(f"{where}: the tensors do not form the model its shapes / config describe "
                              f"(missing {missing[:3]}, unexpected {extra[:3]})")
    for n, shape in expected.items():
        if tuple(state[n].shape) != shape:
            raise CheckpointError(f"{where}: {n} has shape {list(state[n].shape)}, the model's is {list(shape)} "
                                  f"(weights and config disagree)")


def pick_weights(payload: dict, ema: bool) -> tuple[str, dict]:
    """("ema" | "model", its tensors without megatron's `_extra_state` entries) of a joined checkpoint payload: the
    EMA weights when asked for and present."""
    which = "ema" if ema and "ema" in payload else "model"
    return which, {n: t for n, t in payload[which].items() if not n.endswith("_extra_state")}


def saved_causal(payload: dict) -> Optional[dict]:
    """The chunking a causal model's checkpoint records (its saved --causal-* flags, `models/causal.py`) as
    {"chunk_frames", "local_attn_chunks", "sink_chunks", "context_noise"}, or None when its weights run
    bidirectionally: no --causal, or a critic (a Self-Forcing run's args say --causal, but the method builds only
    the student causal: `SelfForcingMethod.model_config`; no method has a causal critic). What an export must not
    hide: no public layout runs a causal model as it was trained."""
    model = (payload.get("args") or {}).get("model") or {}
    if not model.get("causal") or payload.get("role") == "critic":
        return None
    d = CausalLayout()
    return {"chunk_frames": model.get("causal_chunk_frames", d.chunk_frames),
            "local_attn_chunks": model.get("causal_local_attn_chunks", d.window),
            "sink_chunks": model.get("causal_sink_chunks", d.sink),
            "context_noise": model.get("causal_context_noise", 0.0)}


def causal_words(causal: dict) -> str:
    """`saved_causal`'s record in words: "chunks of 3 latent frames, each attending to itself and every earlier
    chunk" (or the last W chunks and the first S)."""
    c = causal
    seen = ("itself and every earlier chunk" if c["local_attn_chunks"] is None else
            f"the last {c['local_attn_chunks']} chunks (its own included)"
            + (f" and the first {c['sink_chunks']}" if c["sink_chunks"] else ""))
    frames = f"{c['chunk_frames']} latent frame{'s' if c['chunk_frames'] != 1 else ''}"
    return f"chunks of {frames}, each attending to {seen}"
