"""Per-rank memory and FLOP maths of one DMD2 cycle, for any model family (behind `launch/plan_memory.py`).

`ModelShape` is a model of a family (the family of its spec, `models.family_of`) on one data shape; `model_shape`
builds it from flags and `model_shape_from_info` from a checkpoint's `data_info`. Each family's formulas
(parameters, FLOPs, activations under TP / CP / SP) are its `ModelFamily.plan` (`models/family.PlanMaths`, in the
family's `plan.py`, whose docstring gives them); what this module adds is the same for every family: role bytes,
the cycle plan, the offload choice and the layout search. P below is parameters per rank, w the weight bytes
(2 under --bf16, else 4).

Role bytes per rank, every family (P = parameters per rank, n = parameter tensors, AdamW):
    weights (P + buffer) w;  grads 4P: the persistent fp32 main_grad buffer (`grad_buffer.GradBuffer`,
    accumulation and DP reduction in place; under --bf16 it is also the masters' grad; a parameter's `.grad`
    is its view: no other gradient tensor);  under --bf16 fp32 masters 4P;  Adam exp_avg +
    exp_avg_sq 8P and one fp32 `step` per tensor 4n. --use-distributed-optimizer: masters (fp32 even for an
    fp32 model) and moments 12P / DP, plus the steps. Everything of a role sleeps with it. Parameters a role's model
    adds to the family's (`plan_cycle`'s `added`: DMD2's GAN head on the critic) are whole on every rank and cost
    what the role's own do (the trainer casts the wrapped model whole under --bf16).
Activations: the family's formulas (a training forward keeps its per-block activations for backward; full
    recompute keeps each block's input plus one block's full set while it is recomputed, selective also each block's
    attention outputs (`models/recompute.py`); a no-grad forward holds its peak). A method's further forwards with
    grad in a phase (`plan_cycle`'s `passes`, `AddedPass`: DMD2's GAN head, its real rows through the critic's first
    blocks and the actor's generator term) are kept beside the phase's own; a forward that stops at block l is
    counted with everything outside the blocks (an overestimate by the final layer's share).
Recompute per phase (`recompute_options`, `choose_recompute`): the phases with grad (critic, actor) each take the
    least recomputing granularity (none, selective, full) whose phase, time-sliced, fits the budget; its cost is the
    recomputed forward FLOPs (`recompute_flops`: full the blocks', selective theirs less the attention cores)
    per backward, as a share of the phase's model FLOPs (critic: K (F + 2F) + scoring; actor: F + 2F). The trainer
    runs one granularity: the planner applies the most recomputing one any phase chose (`applied_recompute`).
Layouts (`search_layouts`): every TP (inside a node) x CP x DP of a world that the family supports (CP and SP only
for a family that splits tokens), at each recompute granularity, each with its cheapest time-slicing
(`choose_offload`); the best fits and has the smallest TP x CP (launch/plan_memory.py --search). The distributed
optimizer shards over DP x CP, the ranks that hold the same weights.
Phases: which roles each phase needs is the method's phase table, passed in (`methods.base.Phase`: name,
needs {role: "all" | "weights"}, trains; DMD2's is `methods.dmd2.phases.table(gan)`, a run's `Method.phases`);
this module, below methods/, never restates it. A role no phase trains is frozen (weights only).
KV cache of a causal student (`kv_cache_plan`, `models/causal.CausalLayout`): a stream of F token frames is split
    into chunks (the first one shorter); while chunk i is written the cache holds, per layer, the k / v of the chunks
    H(i) = kept(i) + [i] (every earlier chunk, or the sink and the last W - 1 with a rolling window) and the text's:
        cache(i)   = N (sum_{j in H(i)} kv_self(T_j) + kv_text)           N layers, T_j tokens of chunk j
        forward(i) = nograd(chunk i) + sum_{j in H(i)} kv_self(T_j)       one chunk's no-grad forward (the family's
                     estimate) and one layer's keys and values concatenated for its attention call (none for chunk 0)
    kv_self / kv_text are the family's per-rank formulas (`PlanMaths.kv_cache`: heads over TP x CP for
    self-attention, over TP for the text). Streaming generation of F frames peaks at max_i cache(i) (+ forward(i));
    the training-time rollout of a causal student (Self-Forcing) is the same stream at the micro-batch over the
    data's frames.
The cycle's cost model (`cycle_passes`, in forwards of B samples) and its comparison with measured
times (`cycle_summary`, `acceptance`) serve benchmarks/bench_dmd2_cycle.py; `format_table` prints both.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from itertools import combinations
from typing import Optional

from dmd2_mega.errors import ConfigError
from dmd2_mega.models import FAMILIES, DataShape, ModelFamily, PlanMaths, family_of, get_spec
from dmd2_mega.models.causal import CausalLayout
from dmd2_mega.models.recompute import GRANULARITIES, granularity

PHASES = ("rollout", "critic", "actor")
"""The phases of a DMD2 cycle whose activations `plan_cycle` estimates (its cost model); which roles each needs is
the phase table the caller passes."""


GRAD_PHASES = ("critic", "actor")
"""The phases whose forwards keep activations for a backward: the ones a recompute granularity applies to."""


@dataclass
class ModelShape:
    """One model of a family (the family of its spec) on one data shape: what the formulas read."""

    spec: object
    """A family's spec (`models.get_spec`)."""
    in_channels: int
    spatial: tuple
    """(H, W) images (an int n means (n, n)) or (T, H, W) video latents, as the family takes them."""
    num_classes: Optional[int] = 10
    cond_shape: Optional[tuple] = None
    """Per-sample text embeddings [D] or [L, D] instead of labels (with cond_parts: their flat [N])."""
    cond_parts: Optional[tuple] = None
    """A condition of parts (`models.DataShape.cond_parts`: an image-to-video Wan's text, CLIP embedding, image)."""

    def __post_init__(self):
        if isinstance(self.spatial, int):
            self.spatial = (self.spatial, self.spatial)
        self.spatial = tuple(int(n) for n in self.spatial)

    @property
    def family(self) -> ModelFamily:
        return family_of(self.spec)

    @property
    def image_size(self) -> int:
        return self.spatial[-1]

    @property
    def patch(self) -> tuple:
        p = self.spec.patch_size
        return tuple(p) if isinstance(p, tuple) else (p,) * len(self.spatial)

    @property
    def token_grid(self) -> tuple:
        """The patch grid: (H, W) of an image model, (F, H, W) of a video model (`FamilyModel.feature_grid`)."""
        return tuple(n // p for n, p in zip(self.spatial, self.patch))

    @property
    def tokens(self) -> int:
        return math.prod(self.token_grid)

    @property
    def text_len(self) -> int:
        """L: the text tokens cross-attention reads (0 for labels or a pooled embedding)."""
        if self.cond_parts:
            return dict(self.cond_parts)["text"][0]
        return self.cond_shape[0] if self.cond_shape is not None and len(self.cond_shape) == 2 else 0

    @property
    def image_len(self) -> int:
        """The image tokens cross-attention also reads (an I2V Wan's CLIP embedding), else 0."""
        return dict(self.cond_parts).get("clip", (0,))[0] if self.cond_parts else 0

    @property
    def sample_numel(self) -> int:
        return self.in_channels * math.prod(self.spatial)

    @property
    def mlp(self) -> int:
        return self.family.mlp_width(self.spec)


def model_shape(size: str, in_channels: int, spatial, patch: Optional[int] = None,
                num_classes: Optional[int] = 10, cond_shape: Optional[tuple] = None,
                cond_parts: Optional[tuple] = None) -> ModelShape:
    """`--model-size` (a registered name or a config.json / folder a family recognises) on latents
    [in_channels, *spatial] as its family takes them (`ModelFamily.plan_spec`: e.g. the DiT's square images with
    `patch`, Wan's (T, H, W) with text [L, text_dim]). ConfigError for a shape the model cannot take."""
    spec = get_spec(size)
    if (num_classes is None) == (cond_shape is None and cond_parts is None):
        raise ConfigError("give exactly one of --num-classes or --cond-shape")
    cond_shape = tuple(cond_shape) if cond_shape is not None else None
    shape = DataShape(in_channels, spatial, num_classes, cond_shape, cond_parts)
    spec = family_of(spec).plan_spec(spec, size, shape, patch)
    return ModelShape(spec, in_channels, shape.spatial, num_classes, shape.cond_shape, shape.cond_parts)


def model_shape_from_info(size: str, info: dict) -> ModelShape:
    """The shape of `--model-size size` on the data a checkpoint's `data_info` describes (`latent_shape`
    [C, *spatial], `num_classes`, `cond_shape`; older infos: `in_channels` + `image_size`). Labels count only
    when the data has no embeddings."""
    shape = DataShape.from_info(info)
    return model_shape(size, shape.in_channels, shape.spatial,
                       num_classes=shape.num_classes if shape.cond_shape is None else None,
                       cond_shape=None if shape.cond_parts else shape.cond_shape, cond_parts=shape.cond_parts)


def param_counts(ms: ModelShape) -> dict:
    """{'sharded': total over TP ranks, 'replicated': per rank, 'tensors': parameter tensors, 'buffer'}."""
    return ms.family.plan.param_counts(ms)


def check_tp(ms: ModelShape, tp: int) -> None:
    """ConfigError unless TP divides the heads and the MLP / FFN width."""
    if ms.spec.num_heads % tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp} must divide the {ms.spec.num_heads} heads")
    if ms.mlp % tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp} must divide the FFN width {ms.mlp}")


def params_per_rank(ms: ModelShape, tp: int) -> int:
    check_tp(ms, tp)
    n = param_counts(ms)
    return n["sharded"] // tp + n["replicated"]


def forward_flops(ms: ModelShape, n: int = 1, tp: int = 1) -> int:
    """Matmul FLOPs of one forward of n samples on one TP rank (see the family's module docstring)."""
    return ms.family.plan.forward_flops(ms, n, tp)


def lora_params(ms: ModelShape, rank: int, tp: int, targets: Optional[tuple] = None) -> tuple[int, int]:
    """(adapter parameters per rank, adapter tensors) of rank-`rank` LoRA adapters on the family's linears
    (`PlanMaths.lora_linears`; only `targets` when given): a column base's A [r, in] whole and B [out / TP, r], a
    row base's A [r, in / TP] and B [out, r] whole (`models/lora.py`)."""
    lins = [x for x in ms.family.plan.lora_linears(ms) if targets is None or x[0] in targets]
    per_rank = sum(rank * (i + o // tp) if kind == "column" else rank * (i // tp + o) for _, kind, i, o in lins)
    return per_rank, 2 * len(lins)


def role_bytes(ms: ModelShape, tp: int, dp: int, bf16: bool, trained: bool, dist_opt: bool = False,
               lora_rank: int = 0, shared: bool = False, added_params: int = 0, added_tensors: int = 0) -> dict:
    """Per-rank bytes of one role by kind: weights, grads (fp32 main_grad buffer), optimizer. `dp` changes only
    the optimizer's part, and only with `dist_opt` (--use-distributed-optimizer: fp32 masters, which it keeps for
    an fp32 model too, and Adam moments are sharded over DP; each rank holds a step count per owned fragment).
    `lora_rank` r > 0: a LoRA role (docs/lora.md), whose grads and optimizer are its adapters' and whose weights are
    its adapters plus, unless `shared` (the teacher's weights: counted once, with the teacher), its frozen base.
    `added_params` in `added_tensors` tensors: parameters the role's model adds to the family's (DMD2's GAN head on
    the critic), whole on every rank and trained with the role. They cost what the role's own do: the trainer casts
    the wrapped model whole (`cast_model` after the method's `init_model`), so w bytes of weights each, 4 of
    main_grad, 12 of optimizer state under --bf16 (an fp32 master like every parameter of a mixed model,
    `train/optim.Optimizer`, and the moments; 8 in fp32), sharded like the rest with `dist_opt`, and a step count
    per tensor."""
    w = 2 if bf16 else 4
    n = param_counts(ms)
    base = params_per_rank(ms, tp) * w + n["buffer"] * w
    P, tensors = lora_params(ms, lora_rank, tp) if lora_rank else (params_per_rank(ms, tp), n["tensors"])
    out = {"weights": (P * w if lora_rank else 0) + (0 if shared else base) + added_params * w, "grads": 0,
           "optimizer": 0}
    if trained:
        P, tensors = P + added_params, tensors + added_tensors
        optimizer = (4 * P if bf16 else 0) + 8 * P + 4 * tensors
        if dist_opt:
            optimizer = math.ceil(12 * P / dp) + 4 * tensors
        out.update(grads=4 * P, optimizer=optimizer)
    return out


def _maths(ms: ModelShape, cp: int, sp: bool) -> PlanMaths:
    """The family's formulas; ConfigError for a token split the family does not have (`splits_tokens`)."""
    family = ms.family
    if not family.splits_tokens and (cp > 1 or sp):
        splitting = " / ".join(f.title for f in FAMILIES if f.splits_tokens)
        raise ConfigError(f"--context-parallel-size / --sequence-parallel are built for the {splitting} family, not "
                          f"--model-size {ms.spec.name} ({family.title})")
    return family.plan


def saved_activation_bytes(ms: ModelShape, n: int, tp: int, bf16: bool, recompute=False, cp: int = 1,
                           sp: bool = False, scores: bool = False, layers: Optional[int] = None) -> int:
    """Estimated bytes a training forward of n samples keeps for its backward (module docstring); `recompute` a
    granularity (a bool: full / none); `cp` and `sp` (a family that splits tokens) split its tokens, `scores` adds
    what SDPA's math path keeps (the family's `PlanMaths.scores`), whose attention selective cannot keep either;
    `layers`: a forward through the first `layers` blocks only (default all; what is outside them still counted)."""
    f, how = _maths(ms, cp, sp), granularity(recompute)
    if how == "none":
        per_layer = layer_activation_bytes(ms, n, tp, bf16, cp, sp, scores)
    else:
        per_layer = f.block_input(ms, n, bf16, tp, cp, sp)
        per_layer += f.attention_kept(ms, n, tp, bf16, cp, sp) if how == "selective" and not scores else 0
    return f.outside(ms, n, tp, bf16, how != "none", cp, sp) + (ms.spec.num_layers if layers is None else layers) \
        * per_layer


@dataclass(frozen=True)
class AddedPass:
    """A forward with grad that a method adds to a phase, kept for that phase's backward (`plan_cycle`'s `passes`;
    DMD2's GAN head: `methods.dmd2.gan.gan_passes`): `rows` samples through the first `layers` blocks of a role's
    model (split over TP / CP / SP like the model's own), and `head` elements in the model dtype that what reads
    their features keeps (the GAN head on the token grid, whole on every rank)."""

    rows: int
    layers: int
    head: int = 0

    def kept_bytes(self, ms: ModelShape, tp: int, bf16: bool, recompute=False, cp: int = 1, sp: bool = False,
                   scores: bool = False) -> int:
        trunk = saved_activation_bytes(ms, self.rows, tp, bf16, recompute, cp, sp, scores, self.layers)
        return (trunk if self.rows else 0) + self.head * (2 if bf16 else 4)


def layer_activation_bytes(ms: ModelShape, n: int, tp: int, bf16: bool, cp: int = 1, sp: bool = False,
                           scores: bool = False) -> int:
    f = _maths(ms, cp, sp)
    return f.layer(ms, n, tp, bf16, cp, sp) + (f.scores(ms, n, tp, bf16, cp, sp) if scores else 0)


def activation_bytes(ms: ModelShape, n: int, tp: int, bf16: bool, grad: bool, recompute=False, cp: int = 1,
                     sp: bool = False, scores: bool = False) -> int:
    """Estimated peak activation bytes of one forward (+ backward when `grad`) of n samples."""
    if not grad:
        return _maths(ms, cp, sp).nograd(ms, n, tp, bf16, cp, sp)
    rerun = granularity(recompute) != "none"  # one block's full set while it is recomputed
    extra = layer_activation_bytes(ms, n, tp, bf16, cp, sp, scores) if rerun else 0
    return saved_activation_bytes(ms, n, tp, bf16, recompute, cp, sp, scores) + extra


def recompute_flops(ms: ModelShape, n: int, tp: int, recompute, scores: bool = False) -> int:
    """Forward FLOPs one backward of n samples runs again on one TP rank: none 0; full the blocks' forward; selective
    the blocks' less their attention cores (all of it on SDPA's math path, `scores`, whose attention it cannot keep)."""
    how = granularity(recompute)
    if how == "none":
        return 0
    return ms.family.plan.recompute_flops(ms, n, tp, how == "selective" and not scores)


@dataclass(frozen=True)
class KVCachePlan:
    """A causal student's KV cache on one rank at its peak over the chunks of a stream (`kv_cache_plan`)."""

    layout: CausalLayout
    frames: int
    """Token frames streamed."""
    chunks: int
    peak_chunk: int
    """The chunk i (from 0) whose forward holds the most: its own k / v written beside kept(i)'s."""
    held: tuple
    """The chunks whose k / v each layer holds at the peak."""
    self_layer: int
    """Self-attention k / v of the held chunks, per layer on one rank."""
    text_layer: int
    """The text's k / v, per layer on one rank."""
    layers: int
    forward: int
    """One chunk's no-grad forward at the peak chunk (module docstring)."""
    group: int
    """TP x CP: the ranks that hold one sample's cache."""

    @property
    def per_layer(self) -> int:
        return self.self_layer + self.text_layer

    @property
    def total(self) -> int:
        """The cache on one rank, every layer."""
        return self.layers * self.per_layer

    @property
    def with_forward(self) -> int:
        return self.total + self.forward

    @property
    def group_total(self) -> int:
        """Summed over the TP x CP ranks (the text's k / v counted on each CP rank, which holds its own copy)."""
        return self.total * self.group


def kv_cache_plan(ms: ModelShape, layout: CausalLayout, n: int, tp: int, bf16: bool, cp: int = 1, sp: bool = False,
                  frames: Optional[int] = None) -> KVCachePlan:
    """The peak over the chunks of a stream of `frames` latent frames (default the data's) of n samples (module
    docstring). ConfigError for a family or spec with no causal student, or frames the temporal patch does not
    divide."""
    f = _maths(ms, cp, sp)
    text = f.kv_cache(ms, n, 1, tp, bf16, cp, sp)[1]  # the family's ConfigError first (no frames to stream)
    latent = ms.spatial[0] if frames is None else frames
    pt = ms.patch[0]
    if latent < 1 or latent % pt:
        raise ConfigError(f"--stream-frames {latent}: a stream needs a positive number of latent frames that the "
                          f"temporal patch {pt} divides")
    spans = layout.chunks(latent // pt)
    size = [b - a for a, b in spans]
    held = [(*layout.kept(i), i) for i in range(len(spans))]
    kv = [sum(f.kv_cache(ms, n, size[j], tp, bf16, cp, sp)[0] for j in h) for h in held]
    i = kv.index(max(kv))
    chunk = dataclasses.replace(ms, spatial=(size[i] * pt, *ms.spatial[1:]))
    forward = f.nograd(chunk, n, tp, bf16, cp, sp) + (kv[i] if len(held[i]) > 1 else 0)
    return KVCachePlan(layout, latent // pt, len(spans), i, held[i], kv[i], text, ms.spec.num_layers, forward,
                       tp * cp)


@dataclass
class CyclePlan:
    """What one rank holds in each phase of a DMD2 cycle; bytes per role and per phase."""

    roles: dict                      # role -> role_bytes(...)
    activations: dict                # phase -> activation bytes (incl. rollout / score tensors)
    needs: dict = field(default_factory=dict)  # phase -> {role: "all" | "weights"}: the method's phase table
    trained: frozenset = frozenset()  # the roles some phase trains (grads and an optimizer); the others are frozen
    phases: dict = field(default_factory=dict)  # (phase, sliced) -> {role: bytes, 'activations', 'total'}
    frozen_share: float = 1.0
    """The part of a time-sliced frozen role (one no phase trains: the teacher) resident while it runs: 1 / experts
    (a model of experts: one expert at a time, `offload.ExpertSleeper`), else 1."""
    shared_base: bool = False
    """LoRA roles share the teacher's weights: nothing is time-sliced (the trainer keeps every role resident)."""

    def resident(self, role: str, need: Optional[str], sliced: bool) -> int:
        """Bytes of `role` resident in a phase that needs it as `need` ("all", "weights", None: not at all),
        time-sliced or not."""
        b = self.roles[role]
        if not sliced or self.shared_base:
            return sum(b.values())
        if need is None:
            return 0
        held = b["weights"] if need == "weights" else sum(b.values())
        return held if role in self.trained else int(held * self.frozen_share)


def table_needs(phases) -> dict:
    """{phase: {role: "all" | "weights"}} of a method's phase table (a sequence of `methods.base.Phase`: name,
    needs, trains); ValueError unless it has exactly the phases of `PHASES` (those the activations are estimated
    for)."""
    needs = {p.name: dict(p.needs) for p in phases}
    if sorted(needs) != sorted(PHASES):
        raise ValueError(f"the memory plan estimates the phases {', '.join(PHASES)}; the table has "
                         f"{', '.join(needs) or 'none'}")
    return needs


def plan_cycle(ms: ModelShape, phases, *, tp: int, dp: int, micro: int, steps: int, denoise: int, bf16: bool,
               recompute=False, guidance: float = 1.0, dist_opt: bool = False, cp: int = 1, sp: bool = False,
               scores: bool = False, lora: Optional[dict] = None, shared_base: bool = True,
               added: Optional[dict] = None, passes: Optional[dict] = None) -> CyclePlan:
    """Per-rank bytes of each role of the method's phase table `phases` (`methods.base.Phase`s: a role some phase
    trains has grads and an optimizer) in each phase, time-sliced (offload) or all resident. The distributed
    optimizer shards over DP x CP (the ranks that hold the same weights); CP / SP split the activations' tokens.
    `lora` {role: rank}: LoRA roles, over the teacher's weights when `shared_base` (`role_bytes`; then nothing is
    time-sliced), else each over its own frozen copy (--no-lora-shared-base). `recompute`: the granularity of every
    forward with grad (a bool: full / none). `added` {role: P or (P, tensors)}: parameters a role's model adds to
    the family's, whole on every rank and trained with the role (DMD2's GAN head on the critic:
    `methods.dmd2.gan.head_plan`; `role_bytes`' added_params); a role not in the table is a ValueError. `passes`
    {phase: [AddedPass]}: forwards with grad a method adds to a phase with grad (critic, actor), kept with the
    phase's own (the GAN head's real rows and generator term: `methods.dmd2.gan.gan_passes`)."""
    needs = table_needs(phases)
    trained = frozenset(p.trains for p in phases if p.trains is not None)
    names = tuple(dict.fromkeys(r for p in phases for r in p.needs))
    ranks = {r: k for r, k in (lora or {}).items() if k}
    shared = bool(ranks) and "teacher" in names and shared_base
    extra = {r: (v, 0) if isinstance(v, int) else tuple(v) for r, v in (added or {}).items()}
    if not set(extra) <= set(names):
        raise ValueError(f"added parameters for {sorted(set(extra) - set(names))}: not a role of the phase table "
                         f"({', '.join(names)})")
    roles = {r: role_bytes(ms, tp, dp * cp, bf16, trained=r in trained, dist_opt=dist_opt, lora_rank=ranks.get(r, 0),
                           shared=shared and r in ranks, added_params=extra.get(r, (0, 0))[0],
                           added_tensors=extra.get(r, (0, 0))[1]) for r in names}
    x = ms.sample_numel * 4                                # one fp32 sample
    cond = 4 * math.prod(ms.cond_shape) if ms.cond_shape is not None else 8
    held_rollout = steps * micro * (2 * x + 24 + cond)     # x, x0hat, sigma, ids, stop steps, cond
    held_scores = micro * 4 * x                            # x, x0_fake, x0_real, x_s
    teacher_n = micro * (2 if guidance != 1.0 else 1)
    kw = dict(cp=cp, sp=sp, scores=scores)
    if not set(passes or {}) <= set(GRAD_PHASES):
        raise ValueError(f"added passes for {sorted(set(passes) - set(GRAD_PHASES))}: only a phase with grad "
                         f"({', '.join(GRAD_PHASES)}) keeps a forward for its backward")
    added_act = {phase: sum(p.kept_bytes(ms, tp, bf16, recompute, **kw) for p in (passes or {}).get(phase, ()))
                 for phase in GRAD_PHASES}
    act = {"rollout": activation_bytes(ms, steps * micro, tp, bf16, grad=False, **kw) + held_rollout
           + steps * micro * 4 * x,
           "critic": max(activation_bytes(ms, micro, tp, bf16, grad=True, recompute=recompute, **kw)
                         + added_act["critic"], activation_bytes(ms, teacher_n, tp, bf16, grad=False, **kw))
           + held_rollout + held_scores,
           "actor": activation_bytes(ms, micro, tp, bf16, grad=True, recompute=recompute, **kw) + held_scores
           + added_act["actor"]}
    experts = ms.family.experts(ms.spec)
    plan = CyclePlan(roles, act, needs, trained, frozen_share=1.0 / experts if experts else 1.0, shared_base=shared)
    for phase in PHASES:
        for sliced in (True, False):
            row = {r: plan.resident(r, needs[phase].get(r), sliced) for r in roles}
            row["activations"] = act[phase]
            row["total"] = sum(row.values())
            plan.phases[(phase, sliced)] = row
    return plan


def phase_bytes(plan: CyclePlan, offloaded) -> dict:
    """phase -> per-rank bytes when the roles in `offloaded` sleep in the phases that do not use them and hold
    only what a phase needs of them (the table's "weights": no grads, no optimizer state); the others stay
    resident."""
    return {phase: plan.activations[phase] + sum(plan.resident(r, plan.needs[phase].get(r), r in offloaded)
                                                 for r in plan.roles)
            for phase in PHASES}


PLAN_HEADROOM = 0.9  # of the device memory: the allocator's fragmentation and temporaries the plan leaves out


def choose_offload(plan: CyclePlan, budget: float) -> tuple[frozenset, dict, bool]:
    """The roles to time-slice so that every phase fits `budget` bytes, moving the fewest bytes per cycle
    (a frozen role's wake, the teacher's, is one copy of its weights; a trained role goes both ways):
    (roles, phase_bytes of that choice, fits). No set fits: every role, fits False. A plan with a shared LoRA base
    time-slices nothing."""
    names = list(plan.roles)
    if plan.shared_base:  # LoRA roles over the teacher's weights: nothing sleeps
        totals = phase_bytes(plan, ())
        return frozenset(), totals, max(totals.values()) <= budget

    def cost(roles) -> int:  # a sleeping role's main_grad is zero and never copied (`train/offload.py`)
        return sum((sum(plan.roles[r].values()) - plan.roles[r].get("grads", 0)) * (2 if r in plan.trained else 1)
                   for r in roles)
    for roles in sorted((frozenset(c) for k in range(len(names) + 1) for c in combinations(names, k)), key=cost):
        totals = phase_bytes(plan, roles)
        if max(totals.values()) <= budget:
            return roles, totals, True
    return frozenset(names), phase_bytes(plan, names), False


def offload_flags(offload, roles) -> list:
    """The trainer's flags that put exactly the roles `offload` of the method's `roles` to sleep: --offload-inactive
    (all), --no-offload-inactive (none), else --offload-roles with the subset (`config.DMD2Config.offload_set`)."""
    offload, roles = frozenset(offload), frozenset(roles)
    if not offload <= roles:
        raise ValueError(f"offload {sorted(offload)} names roles outside {sorted(roles)}")
    if not offload:
        return ["--no-offload-inactive"]
    return ["--offload-inactive"] if offload == roles else ["--offload-roles", ",".join(sorted(offload))]


@dataclass(frozen=True)
class RecomputeOption:
    """One recompute granularity in one phase with grad (`recompute_options`), per rank."""

    phase: str
    granularity: str
    total: int
    """The phase's bytes, time-sliced (every role it does not use asleep): the least the phase can hold."""
    activations: int
    extra_flops: int
    """Forward FLOPs the phase's backwards run again (`recompute_flops`; K of them in the critic phase)."""
    phase_flops: int
    """The phase's model FLOPs (critic: K (F + 2F) + the scoring forwards; actor: F + 2F)."""
    fits: bool

    @property
    def share(self) -> float:
        """The extra FLOPs as a share of the phase's."""
        return self.extra_flops / self.phase_flops


def recompute_options(ms: ModelShape, phases, budget: float, *, scoring: str = "shared", **plan) -> dict:
    """{phase: [RecomputeOption per granularity, least recompute first]} of the phases with grad (`GRAD_PHASES`),
    from `plan_cycle(ms, phases, recompute=g, **plan)` at each granularity; fits: the time-sliced phase within
    `budget` bytes. `plan` may hold `added` (plan_cycle's: a role's extra parameters, DMD2's GAN head)."""
    plans = {g: plan_cycle(ms, phases, recompute=g, **plan) for g in GRANULARITIES}
    n, tp, k, scores = plan["micro"], plan["tp"], plan["steps"], plan.get("scores", False)
    passes = cycle_passes(k, plan["denoise"], plan.get("guidance", 1.0), scoring, recompute=False)
    f = forward_flops(ms, n, tp)
    flops = {"critic": (passes["critic"] + passes["scoring"]) * f, "actor": passes["actor"] * f}
    runs = {"critic": k, "actor": 1}  # backwards per phase
    out = {}
    for phase in GRAD_PHASES:
        rows = []
        for g, p in plans.items():
            row = p.phases[(phase, True)]
            rows.append(RecomputeOption(phase, g, row["total"], row["activations"],
                                        runs[phase] * recompute_flops(ms, n, tp, g, scores), int(flops[phase]),
                                        row["total"] <= budget))
        out[phase] = rows
    return out


def choose_recompute(options: dict, forced=None) -> dict:
    """{phase: the RecomputeOption chosen}: the least recomputing one that fits (the cheapest in FLOPs), full when
    none fits (its `fits` says so); `forced` (--recompute-granularity given) takes that granularity in every phase."""
    if forced is not None:
        return {phase: next(o for o in rows if o.granularity == granularity(forced)) for phase, rows in options.items()}
    return {phase: next((o for o in rows if o.fits), rows[-1]) for phase, rows in options.items()}


def applied_recompute(chosen: dict) -> str:
    """The one granularity a run applies to every phase: the most recomputing one a phase chose (the trainer builds
    each model with one granularity; a phase that chose less then recomputes more than it needs)."""
    return max((o.granularity for o in chosen.values()), key=GRANULARITIES.index, default="none")


@dataclass(frozen=True)
class Layout:
    """A parallel layout of a DMD2 job and the choices that trade memory for time."""

    tp: int
    cp: int
    dp: int
    recompute: str
    """A granularity (`models/recompute.py`; a bool is read as full / none)."""
    offload: frozenset
    """The roles time-sliced (`choose_offload`)."""
    roles: frozenset
    """Every role of the method's phase table (what --offload-inactive puts to sleep)."""
    splits_tokens: bool = True
    """The family takes CP / SP (`ModelFamily.splits_tokens`); one that does not runs with TP and DP only."""

    def __post_init__(self):
        object.__setattr__(self, "recompute", granularity(self.recompute))

    @property
    def sp(self) -> bool:
        """Sequence parallelism rides along whenever TP > 1 (it only removes activation memory)."""
        return self.tp > 1 and self.splits_tokens

    @property
    def dist_opt(self) -> bool:
        """The distributed optimizer whenever the weights have replicas to shard over (DP x CP > 1)."""
        return self.dp * self.cp > 1

    def flags(self) -> list:
        """The trainer flags of this layout (pretrain_dmd2.py)."""
        out = ["--tensor-model-parallel-size", str(self.tp), "--context-parallel-size", str(self.cp)]
        out += ["--sequence-parallel"] if self.sp else []
        out += ["--use-distributed-optimizer"] if self.dist_opt else []
        out += ["--recompute-granularity", self.recompute] if self.recompute != "none" else []
        return out + offload_flags(self.offload, self.roles)

    def describe(self) -> str:
        return (f"TP={self.tp} CP={self.cp} DP={self.dp}{' SP' if self.sp else ''}"
                f"{' dist-opt' if self.dist_opt else ''}, recompute {self.recompute}, "
                f"time-sliced {'+'.join(sorted(self.offload)) or 'none'}")


def search_layouts(ms: ModelShape, phases, *, world: int, gpus_per_node: int, budget: float, micro: int, steps: int,
                   denoise: int, bf16: bool, guidance: float = 1.0, scores: bool = False,
                   lora: Optional[dict] = None, added: Optional[dict] = None, passes: Optional[dict] = None) -> list:
    """Every layout of `world` GPUs the model takes for the method's phase table `phases` (`plan_cycle`; `added`
    its extra parameters of a role and `passes` its extra forwards, DMD2's GAN head), with its plan: [(Layout,
    CyclePlan, phase bytes, fits)],
    best first. TP stays inside a node and divides the heads and the FFN width, TP x CP divides the heads and the
    world (DP = world / (TP x CP)); only a family that splits tokens takes CP > 1 and SP (with TP > 1).
    Best: fits `budget` (bytes per GPU); then the
    smallest model-parallel group TP x CP (the most DP, the least communication); then the least recompute (none,
    selective, full: one granularity for every phase, as the trainer runs it); then the fewest bytes time-sliced per
    cycle; then the smaller TP."""
    heads, found, splits = ms.spec.num_heads, [], ms.family.splits_tokens
    for tp in (t for t in range(1, min(gpus_per_node, heads) + 1) if heads % t == 0 and ms.mlp % t == 0
               and gpus_per_node % t == 0):
        cps = range(1, heads // tp + 1) if splits else (1,)
        for cp in (c for c in cps if (heads // tp) % c == 0 and world % (tp * c) == 0):
            for recompute in GRANULARITIES:
                plan = plan_cycle(ms, phases, tp=tp, dp=world // (tp * cp), micro=micro, steps=steps, denoise=denoise,
                                  bf16=bf16, recompute=recompute, guidance=guidance, dist_opt=world // tp > 1,
                                  cp=cp, sp=tp > 1 and splits, scores=scores, lora=lora, added=added,
                                  passes=passes)
                roles, totals, fits = choose_offload(plan, budget)
                moved = sum(sum(plan.roles[r].values()) for r in roles)
                found.append((Layout(tp, cp, world // (tp * cp), recompute, roles, frozenset(plan.roles), splits),
                              plan, totals, fits, moved))
    if not found:
        raise ConfigError(f"no layout of {world} GPUs ({gpus_per_node} per node) divides the {heads} heads")
    found.sort(key=lambda f: (not f[3], f[0].tp * f[0].cp, GRANULARITIES.index(f[0].recompute), f[4], f[0].tp))
    return [f[:4] for f in found]


def peak(plan: CyclePlan, sliced: bool) -> tuple[str, int]:
    """(phase, bytes) of the largest phase."""
    return max(((p, plan.phases[(p, sliced)]["total"]) for p in PHASES), key=lambda kv: kv[1])


def cycle_passes(steps: int, denoise: int, guidance: float, scoring: str, recompute) -> dict:
    """The analytic pass count of one DMD2 cycle in units of F = one forward of B samples.

    Cost model: a backward costs 2F (3F with full recompute: the forward runs again); optimizer
    steps and elementwise maths are not counted. rollout: K*B samples, sample n runs i_n + 1
    forwards, i_n ~ U{0..N-1}, so K (N + 1) / 2 F on average; critic: K (F + 2F); scoring: the
    teacher's F (2F with CFG), plus with 'original' scoring one no-grad critic forward F; actor:
    F + 2F. A plain flow-matching step is F + 2F. Selective recompute's extra, a model's share of F, is
    `recompute_flops`; here it counts as none.
    """
    bwd = 3.0 if granularity(recompute) == "full" else 2.0
    out = {"rollout": steps * (denoise + 1) / 2, "critic": steps * (1 + bwd),
           "scoring": (2.0 if guidance != 1.0 else 1.0) + (1.0 if scoring == "original" else 0.0),
           "actor": 1 + bwd}
    out["cycle"] = sum(out.values())
    out["plain_step"] = 1 + bwd
    return out


def describe_passes(p: dict, drawn: float) -> str:
    """The cost model of `cycle_passes` in words (drawn: the measured rollouts' sample-forwards / B)."""
    return (f"cost model: F = one forward of B samples, backward {p['plain_step'] - 1:g}F, optimizer steps not "
            f"counted; rollout K(N+1)/2 = {p['rollout']:g}F (drawn stop steps: {drawn:.2f}F), critic {p['critic']:g}F, "
            f"scoring {p['scoring']:g}F (original +1F), actor {p['actor']:g}F: cycle {p['cycle']:g}F; plain step "
            f"{p['plain_step']:g}F -> nominal minimum {p['cycle'] / p['plain_step']:.2f} plain steps (the analytic "
            "minimum below costs the K + 1 steps at the measured plain step, the forward-only passes at the measured "
            "F)")


def cycle_summary(t: dict, passes: dict, *, k: int, b: int, drawn: float, flops_per_sample: int,
                  peak_tflops: Optional[float] = None) -> dict:
    """A measured cycle against the cost model of `cycle_passes` (benchmarks/bench_dmd2_cycle.py).

    t: median ms of 'cycle' (shared, offload off), 'cycle_offload' (offload on), 'phases' (the sum of the
    standalone phases), 'in_rollout' (the rollout's span inside the cycle), 'plain' (a plain flow step), 'F' (a
    B-sample forward), 'F_KB' (a K*B-sample forward), 'gap' (critic-phase time original - shared, paired on
    one rollout), 'critic_fwd' (the no-grad critic forward original adds). drawn: rollout sample-forwards / B.
    Model FLOPs: the passes (rollout at the drawn stop steps) x forward FLOPs, recompute not counted.

    The analytic minimum is the cycle's passes at their measured unit costs: its K + 1 training steps (K critic
    steps, one actor step) at one plain step each, and its forward-only passes (the rollout at the drawn stop
    steps, the scoring) at F each. A backward's cost relative to a forward differs by model and machine (2F is
    the cost model's nominal; wan-digits on CPU measures ~1.65F), so the minimum takes the measured one; with a
    plain step of exactly `passes['plain_step']` F and the expected stop steps it is the nominal
    passes['cycle'] / passes['plain_step'].
    """
    p = t["plain"] / t["F"]  # a plain step in forwards, as measured
    forwards = drawn + passes["scoring"]  # the cycle's forward-only passes, in F
    floor, units = forwards / p + k + 1, t["cycle"] / t["plain"]
    rest_floor = floor - drawn / p
    recomputed = (passes["plain_step"] - 3.0) * (k + 1)  # full recompute: one more forward per backward (K + 1)
    flops = flops_per_sample * b * (drawn + passes["cycle"] - passes["rollout"] - recomputed)
    tflops = flops / (t["cycle"] * 1e-3) / 1e12
    out = {"overhead ratio (cycle / sum of phases)": t["cycle"] / t["phases"], "cycle in plain steps": units,
           "plain step in F (measured)": p, "analytic minimum in plain steps": floor,
           "nominal minimum (backward as the cost model)": passes["cycle"] / passes["plain_step"],
           "cycle / analytic minimum": units / floor,
           "rollout / (drawn sample-forwards x F/B)": t["in_rollout"] / (drawn * t["F"]),
           "fwd of K*B / (K F)": t["F_KB"] / (k * t["F"]),
           "cycle without rollout / its analytic minimum": (t["cycle"] - t["in_rollout"]) / t["plain"] / rest_floor,
           "original - shared critic phase, paired (ms)": t["gap"],
           "critic fwd of the scored batch (ms)": t["critic_fwd"],
           "offload on / off (cycle time)": t["cycle_offload"] / t["cycle"],
           "samples/s (B actor samples per cycle)": b / t["cycle"] * 1e3,
           "rollout samples/s (K*B per cycle)": k * b / t["cycle"] * 1e3, "analytic TFLOP/s (model FLOPs)": tflops}
    if peak_tflops:
        out.update({"peak TFLOP/s": peak_tflops, "MFU %": 100 * tflops / peak_tflops})
    return out


def acceptance(s: dict, mem: list, persistent: float) -> list:
    """Issue 5's targets: [(what, value, ok)]. mem: per phase [name, roles_off, roles_on, needed_roles, ...]
    (role storage, offload off / on, and the phase's own roles); persistent: all roles' bytes, grads freed."""
    over, ratio = s["overhead ratio (cycle / sum of phases)"], s["cycle / analytic minimum"]
    gap = s["original - shared critic phase, paired (ms)"] / s["critic fwd of the scored batch (ms)"]
    peak_on, largest, low_off = max(r[2] for r in mem), max(r[3] for r in mem), min(r[1] for r in mem)
    return [("overhead ratio <= 1.05", over, over <= 1.05),
            ("cycle <= 1.1x analytic minimum (plain-step units)", ratio, ratio <= 1.1),
            ("original - shared ~ one critic forward (0.5-1.5x)", gap, 0.5 <= gap <= 1.5),
            ("offload on: peak <= 1.1x largest phase", peak_on / largest, peak_on <= 1.1 * largest),
            ("offload off: every phase holds all roles (min / sum)", low_off / persistent, low_off >= persistent)]


def format_table(head: list, rows: list, left: int = 1) -> str:
    """Rows as aligned columns under a rule (the first `left` left-aligned); numbers as 4 significant digits."""
    cells = [head] + [[c if isinstance(c, str) else "" if c is None else f"{c:.4g}" for c in r] for r in rows]
    widths = [max(len(r[j]) for r in cells) for j in range(len(head))]
    lines = ["  ".join(c.ljust(w) if j < left else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths)))
             for r in cells]
    return "\n".join(lines[:1] + ["  ".join("-" * w for w in widths)] + lines[1:])
