"""Per-rank memory and FLOP maths of the model families and of one DMD2 cycle (behind `launch/plan_memory.py`).

`ModelShape` is a model of either family (DiT or Wan, told apart by its spec) on one data shape; `model_shape`
builds it from flags and `model_shape_from_info` from a checkpoint's `data_info`. Each family's formulas are
one `FamilyMaths` row of `FAMILY_MATHS`: the DiT's below, Wan's in `memory_plan_wan.py` (its docstring gives
them). Role bytes, the cycle plan and the offload choice are the same for every family.

DiT notation: hidden h, layers L, heads a, patch p, channels C, image side H, tokens S = (H / p)^2,
MLP width m = int(h * mlp_ratio), timestep feature width f, TP degree t, micro-batch B, K critic
steps, N student steps. Weight bytes w = 2 under --bf16 else 4; activation bytes = w.

Parameters (exact; megatron-core splits the output dim of ColumnParallelLinear and the input dim
of RowParallelLinear, RowParallelLinear's bias stays whole):
    sharded (divided by t):  per block adaLN 6h(h+1), qkv 3h(h+1), proj h^2, fc1 m(h+1), fc2 mh;
                             final adaLN 2h(h+1)
    replicated:              x_embed (Cp^2+1)h, t_embed (f+1)h + (h+1)h, labels (classes+1)h or
                             text (D+1)h + (h+1)h, per block the proj and fc2 biases 2h,
                             final (h+1)p^2C
    buffer:                  pos [S, h] and, with text, the negative-prompt embedding (model dtype)
Role bytes per rank, every family (P = parameters per rank, n = parameter tensors, AdamW):
    weights (P + buffer) w;  grads 4P: the persistent fp32 main_grad buffer (`grad_buffer.GradBuffer`,
    accumulation and DP reduction in place; under --bf16 it is also the masters' grad; the model-dtype
    `.grad` of one parameter lives only until its hook);  under --bf16 fp32 masters 4P;  Adam exp_avg +
    exp_avg_sq 8P and one fp32 `step` per tensor 4n. --use-distributed-optimizer: masters (fp32 even for an
    fp32 model) and moments 12P / DP, plus the steps. Everything of a role sleeps with it.
Activations of a training forward of n samples, kept for backward (no S^2 term: SDPA/flash keep
    the log-sum-exp only), per layer:  n S (8h + (5h + 2m) / t) w + n (a / t) S 4
    (layer-norm inputs/outputs, modulated inputs, attention projection and fc2 outputs at full width;
    q, k, v, attention output and its re-laid copy, fc1 output and GELU output per TP shard),
    plus n S (3h + Cp^2) w outside the blocks. --recompute-granularity full keeps only each block's
    input n S h w, plus one block's full set while that block is recomputed in backward.
    A no-grad forward of n samples holds about n S (4h + max(3h, 2m) / t) w at its peak.
    Measured on CPU with saved-tensor hooks (tests/test_plan_memory.py) the kept bytes are within
    1.25x of this estimate; the peak also holds temporaries of the op running at that moment.
Forward FLOPs per sample (matmuls, 2 per multiply-add, per TP rank), attention included:
    2 S (Cp^2 h + h p^2 C) + 2 (f h + h^2 + [text: D h + h^2]) + 2 h 2h / t
    + L [2 h 6h / t + 2 S (3h^2 + h^2 + 2 h m) / t + 4 S^2 h / t]
Layouts (`search_layouts`): every TP (inside a node) x CP x DP of a world, with and without recompute, each with
its cheapest time-slicing (`choose_offload`); the best fits and has the smallest TP x CP (launch/plan_memory.py
--search). The distributed optimizer shards over DP x CP, the ranks that hold the same weights.
The cycle's cost model (`cycle_passes`, in forwards of B samples) and its comparison with measured
times (`cycle_summary`, `acceptance`) serve benchmarks/bench_dmd2_cycle.py; `format_table` prints both.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from itertools import combinations
from typing import Callable, NamedTuple, Optional

from dmd2_mega.plan import memory_plan_wan as wan
from dmd2_mega.errors import ConfigError
from dmd2_mega.models import DataShape, get_spec
from dmd2_mega.models.wan import WanSpec
from dmd2_mega.models.wan import check_shape as check_wan_shape

PHASES = ("rollout", "critic", "actor")
# phase -> (roles resident when time-sliced, the role trained in it)  (mirrors dmd2/roles.PHASE_ROLES)
PHASE_NEEDS = {"rollout": (("student",), None), "critic": (("critic", "teacher"), "critic"),
               "actor": (("student",), "student")}


@dataclass
class ModelShape:
    """One model of a family (DiT or Wan, by its spec) on one data shape: what the formulas read."""

    spec: object
    """DiTSpec or WanSpec (`models.get_spec`)."""
    in_channels: int
    spatial: tuple
    """(H, W) images (the DiT's are square; an int n means (n, n)) or (T, H, W) video latents (Wan)."""
    num_classes: Optional[int] = 10
    cond_shape: Optional[tuple] = None
    """Per-sample text embeddings [D] or [L, D] instead of labels; Wan: [L, text_dim]."""

    def __post_init__(self):
        if isinstance(self.spatial, int):
            self.spatial = (self.spatial, self.spatial)
        self.spatial = tuple(int(n) for n in self.spatial)

    @property
    def family(self) -> str:
        return "wan" if isinstance(self.spec, WanSpec) else "dit"

    @property
    def image_size(self) -> int:
        return self.spatial[-1]

    @property
    def patch(self) -> tuple:
        p = self.spec.patch_size
        return tuple(p) if isinstance(p, tuple) else (p,) * len(self.spatial)

    @property
    def tokens(self) -> int:
        return math.prod(n // p for n, p in zip(self.spatial, self.patch))

    @property
    def text_len(self) -> int:
        """L: the text tokens cross-attention reads (0 for labels or a pooled embedding)."""
        return self.cond_shape[0] if self.cond_shape is not None and len(self.cond_shape) == 2 else 0

    @property
    def sample_numel(self) -> int:
        return self.in_channels * math.prod(self.spatial)

    @property
    def mlp(self) -> int:
        return self.spec.ffn_dim if self.family == "wan" else int(self.spec.hidden_size * self.spec.mlp_ratio)


def model_shape(size: str, in_channels: int, spatial, patch: Optional[int] = None,
                num_classes: Optional[int] = 10, cond_shape: Optional[tuple] = None) -> ModelShape:
    """`--model-size` (a registered name or a diffusers config.json / folder) on latents [in_channels, *spatial]
    (spatial: the DiT's image side, or (T, H, W) for Wan, whose cond_shape is [L, text_dim]). ConfigError for
    a shape the model cannot take."""
    spec = get_spec(size)
    if (num_classes is None) == (cond_shape is None):
        raise ConfigError("give exactly one of --num-classes or --cond-shape")
    cond_shape = tuple(cond_shape) if cond_shape is not None else None
    if isinstance(spec, WanSpec):
        if patch is not None:
            raise ConfigError(f"--patch applies to the DiT; --model-size {size} (Wan) has patch {spec.patch_size}")
        ms = ModelShape(spec, in_channels, spatial, num_classes, cond_shape)
        check_wan_shape(spec, DataShape(in_channels, ms.spatial, num_classes, cond_shape), 1)
        return ms
    if patch is not None:
        spec = replace(spec, patch_size=patch)
    ms = ModelShape(spec, in_channels, spatial, num_classes, cond_shape)
    if len(ms.spatial) != 2 or ms.spatial[0] != ms.spatial[1]:
        raise ConfigError(f"--model-size {size} (DiT) takes square images [C, H, H], got latents "
                          f"{[in_channels, *ms.spatial]}")
    if ms.image_size % spec.patch_size:
        raise ConfigError(f"--image-size {ms.image_size} is not a multiple of --patch {spec.patch_size}")
    return ms


def model_shape_from_info(size: str, info: dict) -> ModelShape:
    """The shape of `--model-size size` on the data a checkpoint's `data_info` describes (`latent_shape`
    [C, *spatial], `num_classes`, `cond_shape`; older infos: `in_channels` + `image_size`). Labels count only
    when the data has no embeddings."""
    shape = DataShape.from_info(info)
    return model_shape(size, shape.in_channels, shape.spatial,
                       num_classes=shape.num_classes if shape.cond_shape is None else None,
                       cond_shape=shape.cond_shape)


class FamilyMaths(NamedTuple):
    """One family's formulas (module docstrings): param_counts(ms); forward_flops(ms, n, tp); per block
    layer(ms, n, tp, bf16, cp, sp) kept for backward and block_input(ms, n, bf16, tp, cp, sp) under full
    recompute; outside(ms, n, tp, bf16, recompute, cp, sp) kept outside the blocks; nograd(ms, n, tp, bf16, cp,
    sp) the peak of a no-grad forward; scores(ms, n, tp, bf16, cp, sp) per block, what SDPA's math path keeps
    beyond the fused kernels. cp / sp split the tokens (CP, sequence parallelism); a family without them is
    only ever asked for cp = 1, sp = False (`_maths`)."""

    param_counts: Callable
    forward_flops: Callable
    layer: Callable
    block_input: Callable
    outside: Callable
    nograd: Callable
    scores: Callable


def _dit_param_counts(ms: ModelShape) -> dict:
    s, h, m, c, p = ms.spec, ms.spec.hidden_size, ms.mlp, ms.in_channels, ms.spec.patch_size
    per_block = 6 * h * (h + 1) + 3 * h * (h + 1) + h * h + m * (h + 1) + m * h
    sharded = s.num_layers * per_block + 2 * h * (h + 1)
    cond = (ms.num_classes + 1) * h if ms.num_classes is not None else (ms.cond_shape[-1] + 1) * h + (h + 1) * h
    replicated = ((c * p * p + 1) * h + (s.freq_dim + 1) * h + (h + 1) * h + cond
                  + 2 * h * s.num_layers + (h + 1) * p * p * c)
    tensors = 2 + 4 + (1 if ms.num_classes is not None else 4) + 10 * s.num_layers + 2 + 2
    negative = math.prod(ms.cond_shape) if ms.cond_shape is not None else 0
    return {"sharded": sharded, "replicated": replicated, "tensors": tensors, "buffer": ms.tokens * h + negative}


def _dit_forward_flops(ms: ModelShape, n: int = 1, tp: int = 1) -> int:
    s, h, m, c, p, S = ms.spec, ms.spec.hidden_size, ms.mlp, ms.in_channels, ms.spec.patch_size, ms.tokens
    out = 2 * S * (c * p * p * h + h * p * p * c) + 2 * (s.freq_dim * h + h * h) + 2 * h * 2 * h // tp
    if ms.cond_shape is not None:
        out += 2 * (ms.cond_shape[-1] * h + h * h)
    block = 2 * h * 6 * h + 2 * S * (3 * h * h + h * h + 2 * h * m) + 4 * S * S * h
    return n * (out + s.num_layers * block // tp)


def _dit_layer(ms: ModelShape, n: int, tp: int, bf16: bool, cp: int = 1, sp: bool = False) -> int:
    h, m, S, w = ms.spec.hidden_size, ms.mlp, ms.tokens, 2 if bf16 else 4
    return n * S * (8 * h + (5 * h + 2 * m) // tp) * w + n * (ms.spec.num_heads // tp) * S * 4


def _dit_block_input(ms: ModelShape, n: int, bf16: bool, tp: int = 1, cp: int = 1, sp: bool = False) -> int:
    return n * ms.tokens * ms.spec.hidden_size * (2 if bf16 else 4)


def _dit_outside(ms: ModelShape, n: int, tp: int, bf16: bool, recompute: bool, cp: int = 1, sp: bool = False) -> int:
    return n * ms.tokens * (3 * ms.spec.hidden_size + ms.in_channels * ms.spec.patch_size ** 2) * (2 if bf16 else 4)


def _dit_nograd(ms: ModelShape, n: int, tp: int, bf16: bool, cp: int = 1, sp: bool = False) -> int:
    h, S, w = ms.spec.hidden_size, ms.tokens, 2 if bf16 else 4
    return n * S * (4 * h + max(3 * h, 2 * ms.mlp) // tp) * w


def _dit_scores(ms: ModelShape, *_) -> int:
    raise ConfigError("--attention-kernel math is modelled for the Wan family only")


FAMILY_MATHS = {
    "dit": FamilyMaths(_dit_param_counts, _dit_forward_flops, _dit_layer, _dit_block_input, _dit_outside,
                       _dit_nograd, _dit_scores),
    "wan": FamilyMaths(wan.param_counts, wan.forward_flops, wan.layer_activation_bytes, wan.block_input_bytes,
                       wan.outside_activation_bytes, wan.nograd_activation_bytes, wan.score_bytes),
}


def param_counts(ms: ModelShape) -> dict:
    """{'sharded': total over TP ranks, 'replicated': per rank, 'tensors': parameter tensors, 'buffer'}."""
    return FAMILY_MATHS[ms.family].param_counts(ms)


def check_tp(ms: ModelShape, tp: int) -> None:
    """ConfigError unless TP divides the heads (and Wan's FFN width)."""
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
    return FAMILY_MATHS[ms.family].forward_flops(ms, n, tp)


def role_bytes(ms: ModelShape, tp: int, dp: int, bf16: bool, trained: bool, dist_opt: bool = False) -> dict:
    """Per-rank bytes of one role by kind: weights, grads (fp32 main_grad buffer), optimizer. `dp` changes only
    the optimizer's part, and only with `dist_opt` (--use-distributed-optimizer: fp32 masters, which it keeps for
    an fp32 model too, and Adam moments are sharded over DP; each rank holds a step count per owned fragment)."""
    P, w = params_per_rank(ms, tp), 2 if bf16 else 4
    n = param_counts(ms)
    out = {"weights": P * w + n["buffer"] * w, "grads": 0, "optimizer": 0}
    if trained:
        optimizer = (4 * P if bf16 else 0) + 8 * P + 4 * n["tensors"]
        if dist_opt:
            optimizer = math.ceil(12 * P / dp) + 4 * n["tensors"]
        out.update(grads=4 * P, optimizer=optimizer)
    return out


def _maths(ms: ModelShape, cp: int, sp: bool) -> FamilyMaths:
    """The family's formulas; ConfigError for a token split the family does not have (only Wan splits tokens)."""
    if ms.family != "wan" and (cp > 1 or sp):
        raise ConfigError(f"--context-parallel-size / --sequence-parallel are built for the Wan family, not "
                          f"--model-size {ms.spec.name} ({ms.family})")
    return FAMILY_MATHS[ms.family]


def saved_activation_bytes(ms: ModelShape, n: int, tp: int, bf16: bool, recompute: bool = False, cp: int = 1,
                           sp: bool = False, scores: bool = False) -> int:
    """Estimated bytes a training forward of n samples keeps for its backward (module docstring); `cp` and `sp`
    (Wan only) split its tokens, `scores` (Wan only) adds what SDPA's math path keeps (memory_plan_wan.py)."""
    f = _maths(ms, cp, sp)
    per_layer = (f.block_input(ms, n, bf16, tp, cp, sp) if recompute
                 else layer_activation_bytes(ms, n, tp, bf16, cp, sp, scores))
    return f.outside(ms, n, tp, bf16, recompute, cp, sp) + ms.spec.num_layers * per_layer


def layer_activation_bytes(ms: ModelShape, n: int, tp: int, bf16: bool, cp: int = 1, sp: bool = False,
                           scores: bool = False) -> int:
    f = _maths(ms, cp, sp)
    return f.layer(ms, n, tp, bf16, cp, sp) + (f.scores(ms, n, tp, bf16, cp, sp) if scores else 0)


def activation_bytes(ms: ModelShape, n: int, tp: int, bf16: bool, grad: bool, recompute: bool = False, cp: int = 1,
                     sp: bool = False, scores: bool = False) -> int:
    """Estimated peak activation bytes of one forward (+ backward when `grad`) of n samples."""
    if not grad:
        return _maths(ms, cp, sp).nograd(ms, n, tp, bf16, cp, sp)
    extra = layer_activation_bytes(ms, n, tp, bf16, cp, sp, scores) if recompute else 0  # the block recomputed
    return saved_activation_bytes(ms, n, tp, bf16, recompute, cp, sp, scores) + extra


@dataclass
class CyclePlan:
    """What one rank holds in each phase of a DMD2 cycle; bytes per role and per phase."""

    roles: dict                      # role -> role_bytes(...)
    activations: dict                # phase -> activation bytes (incl. rollout / score tensors)
    phases: dict = field(default_factory=dict)  # (phase, sliced) -> {role: bytes, 'activations', 'total'}
    teacher_share: float = 1.0
    """The part of a time-sliced teacher resident while it runs: 1 / experts (Wan 2.2: one expert at a time,
    `offload.ExpertSleeper`), else 1."""

    def resident(self, role: str, in_phase: bool, sliced: bool) -> int:
        """Bytes of `role` resident in a phase that needs it (`in_phase`) or not, time-sliced or not."""
        full = sum(self.roles[role].values())
        if not sliced:
            return full
        if not in_phase:
            return 0
        return int(full * self.teacher_share) if role == "teacher" else full


def plan_cycle(ms: ModelShape, *, tp: int, dp: int, micro: int, steps: int, denoise: int, bf16: bool,
               recompute: bool = False, guidance: float = 1.0, dist_opt: bool = False, cp: int = 1, sp: bool = False,
               scores: bool = False) -> CyclePlan:
    """Per-rank bytes of each role in each phase, time-sliced (offload) or all resident. The distributed optimizer
    shards over DP x CP (the ranks that hold the same weights); CP / SP split the activations' tokens."""
    roles = {r: role_bytes(ms, tp, dp * cp, bf16, trained=r != "teacher", dist_opt=dist_opt)
             for r in ("student", "critic", "teacher")}
    x = ms.sample_numel * 4                                # one fp32 sample
    cond = 4 * math.prod(ms.cond_shape) if ms.cond_shape is not None else 8
    held_rollout = steps * micro * (2 * x + 24 + cond)     # x, x0hat, sigma, ids, stop steps, cond
    held_scores = micro * 4 * x                            # x, x0_fake, x0_real, x_s
    teacher_n = micro * (2 if guidance != 1.0 else 1)
    kw = dict(cp=cp, sp=sp, scores=scores)
    act = {"rollout": activation_bytes(ms, steps * micro, tp, bf16, grad=False, **kw) + held_rollout
           + steps * micro * 4 * x,
           "critic": max(activation_bytes(ms, micro, tp, bf16, grad=True, recompute=recompute, **kw),
                         activation_bytes(ms, teacher_n, tp, bf16, grad=False, **kw)) + held_rollout + held_scores,
           "actor": activation_bytes(ms, micro, tp, bf16, grad=True, recompute=recompute, **kw) + held_scores}
    experts = len(getattr(ms.spec, "experts", ()))
    plan = CyclePlan(roles, act, teacher_share=1.0 / experts if experts else 1.0)
    for phase in PHASES:
        needed = PHASE_NEEDS[phase][0]
        for sliced in (True, False):
            row = {r: plan.resident(r, r in needed, sliced) for r in roles}
            row["activations"] = act[phase]
            row["total"] = sum(row.values())
            plan.phases[(phase, sliced)] = row
    return plan


def phase_bytes(plan: CyclePlan, offloaded, gan: bool = False) -> dict:
    """phase -> per-rank bytes when the roles in `offloaded` sleep in the phases that do not use them (the
    others stay resident). With the GAN head the actor phase also needs the critic's weights."""
    out = {}
    for phase in PHASES:
        needed = PHASE_NEEDS[phase][0]
        total = plan.activations[phase]
        for r, b in plan.roles.items():
            if r not in offloaded or r in needed:
                total += plan.resident(r, r in needed, r in offloaded)
            elif gan and phase == "actor" and r == "critic":
                total += b["weights"]
        out[phase] = total
    return out


PLAN_HEADROOM = 0.9  # of the device memory: the allocator's fragmentation and temporaries the plan leaves out


def choose_offload(plan: CyclePlan, budget: float, gan: bool = False) -> tuple[frozenset, dict, bool]:
    """The roles to time-slice so that every phase fits `budget` bytes, moving the fewest bytes per cycle
    (a frozen teacher's wake is one copy of its weights; a trained role goes both ways):
    (roles, phase_bytes of that choice, fits). No set fits: all three roles, fits False."""
    names = list(plan.roles)

    def cost(roles) -> int:
        return sum(sum(plan.roles[r].values()) * (1 if r == "teacher" else 2) for r in roles)
    for roles in sorted((frozenset(c) for k in range(len(names) + 1) for c in combinations(names, k)), key=cost):
        totals = phase_bytes(plan, roles, gan)
        if max(totals.values()) <= budget:
            return roles, totals, True
    return frozenset(names), phase_bytes(plan, names, gan), False


@dataclass(frozen=True)
class Layout:
    """A parallel layout of a DMD2 job and the choices that trade memory for time."""

    tp: int
    cp: int
    dp: int
    recompute: bool
    offload: frozenset
    """The roles time-sliced (`choose_offload`)."""
    splits_tokens: bool = True
    """The family takes CP / SP (Wan); the DiT family runs with TP and DP only."""

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
        out += ["--recompute-granularity", "full"] if self.recompute else []
        return out + (["--offload-inactive"] if self.offload else ["--no-offload-inactive"])

    def describe(self) -> str:
        return (f"TP={self.tp} CP={self.cp} DP={self.dp}{' SP' if self.sp else ''}"
                f"{' dist-opt' if self.dist_opt else ''}, recompute {'full' if self.recompute else 'none'}, "
                f"time-sliced {'+'.join(sorted(self.offload)) or 'none'}")


def search_layouts(ms: ModelShape, *, world: int, gpus_per_node: int, budget: float, micro: int, steps: int,
                   denoise: int, bf16: bool, guidance: float = 1.0, scores: bool = False, gan: bool = False) -> list:
    """Every layout of `world` GPUs the model takes, with its plan: [(Layout, CyclePlan, phase bytes, fits)],
    best first. TP stays inside a node and divides the heads and the FFN width, TP x CP divides the heads and the
    world (DP = world / (TP x CP)); Wan only splits tokens (CP > 1, SP with TP > 1; the DiT family takes neither).
    Best: fits `budget` (bytes per GPU); then the
    smallest model-parallel group TP x CP (the most DP, the least communication); then no recompute; then the
    fewest bytes time-sliced per cycle; then the smaller TP."""
    heads, found = ms.spec.num_heads, []
    for tp in (t for t in range(1, min(gpus_per_node, heads) + 1) if heads % t == 0 and ms.mlp % t == 0
               and gpus_per_node % t == 0):
        cps = range(1, heads // tp + 1) if ms.family == "wan" else (1,)
        for cp in (c for c in cps if (heads // tp) % c == 0 and world % (tp * c) == 0):
            for recompute in (False, True):
                plan = plan_cycle(ms, tp=tp, dp=world // (tp * cp), micro=micro, steps=steps, denoise=denoise,
                                  bf16=bf16, recompute=recompute, guidance=guidance, dist_opt=world // tp > 1,
                                  cp=cp, sp=tp > 1 and ms.family == "wan", scores=scores)
                roles, totals, fits = choose_offload(plan, budget, gan)
                moved = sum(sum(plan.roles[r].values()) for r in roles)
                found.append((Layout(tp, cp, world // (tp * cp), recompute, roles, ms.family == "wan"), plan, totals,
                              fits, moved))
    if not found:
        raise ConfigError(f"no layout of {world} GPUs ({gpus_per_node} per node) divides the {heads} heads")
    found.sort(key=lambda f: (not f[3], f[0].tp * f[0].cp, f[0].recompute, f[4], f[0].tp))
    return [f[:4] for f in found]


def peak(plan: CyclePlan, sliced: bool) -> tuple[str, int]:
    """(phase, bytes) of the largest phase."""
    return max(((p, plan.phases[(p, sliced)]["total"]) for p in PHASES), key=lambda kv: kv[1])


def cycle_passes(steps: int, denoise: int, guidance: float, scoring: str, recompute: bool) -> dict:
    """The analytic pass count of one DMD2 cycle in units of F = one forward of B samples.

    Cost model: a backward costs 2F (3F with full recompute: the forward runs again); optimizer
    steps and elementwise maths are not counted. rollout: K*B samples, sample n runs i_n + 1
    forwards, i_n ~ U{0..N-1}, so K (N + 1) / 2 F on average; critic: K (F + 2F); scoring: the
    teacher's F (2F with CFG), plus with 'original' scoring one no-grad critic forward F; actor:
    F + 2F. A plain flow-matching step is F + 2F.
    """
    bwd = 3.0 if recompute else 2.0
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
            f"{p['plain_step']:g}F -> analytic minimum {p['cycle'] / p['plain_step']:.2f} plain steps")


def cycle_summary(t: dict, passes: dict, *, k: int, b: int, drawn: float, flops_per_sample: int,
                  peak_tflops: Optional[float] = None) -> dict:
    """A measured cycle against the cost model of `cycle_passes` (benchmarks/bench_dmd2_cycle.py).

    t: median ms of 'cycle' (shared, offload off), 'cycle_offload' (offload on), 'phases' (the sum of the
    standalone phases), 'in_rollout' (the rollout's span inside the cycle), 'plain' (a plain flow step), 'F' (a
    B-sample forward), 'F_KB' (a K*B-sample forward), 'gap' (critic-phase time original - shared, paired on
    one rollout), 'critic_fwd' (the no-grad critic forward original adds). drawn: rollout sample-forwards / B.
    Model FLOPs: the passes (rollout at the drawn stop steps) x forward FLOPs, recompute not counted.
    """
    floor, units = passes["cycle"] / passes["plain_step"], t["cycle"] / t["plain"]
    rest_floor = floor - passes["rollout"] / passes["plain_step"]
    recomputed = (passes["plain_step"] - 3.0) * (k + 1)  # full recompute: one more forward per backward (K + 1)
    flops = flops_per_sample * b * (drawn + passes["cycle"] - passes["rollout"] - recomputed)
    tflops = flops / (t["cycle"] * 1e-3) / 1e12
    out = {"overhead ratio (cycle / sum of phases)": t["cycle"] / t["phases"], "cycle in plain steps": units,
           "analytic minimum in plain steps": floor, "cycle / analytic minimum": units / floor,
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
