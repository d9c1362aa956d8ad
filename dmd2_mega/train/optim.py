"""Optimizer, LR schedule and TP/DP-correct gradient clipping, written thinly over torch.

megatron-core's optimizer needs CUDA and does not keep Adam's step count across a resume, so
the optimizer is torch's fused AdamW (its multi-tensor kernel, on CUDA and on CPU) or apex FusedAdam
(`--optimizer-impl apex`), with two parameter groups: weight decay on matrices, none on biases, norms and
embedding tables. A model may set options of its own for some parameters (`param_options`, e.g. DMD2's GAN head):
their groups then carry their own lr multiplier and weight decay, and they are clipped apart (below).

Gradients: with a `grad_buffer.GradBuffer` (both trainers attach one) they arrive in the fp32 `main_grad`
views of one flat buffer, accumulated (by autograd: they are the parameters' `.grad`) and DP-reduced in fp32
(Megatron's scheme); `step` first completes that reduction. The tensors the step reads are then fixed for the
optimizer's life, so the step has no Python loop over parameters: the norm is the whole buffer's (one launch; under
TP or with clip groups, foreach lists made once), the clip is one multiply of the buffer (with clip groups: one
multiply per group of the buffer slices its parameters occupy, adjacent ones merged, so each gradient is scaled
once, by its own group's coefficient: exact), `zero_grad` one zero of it. Without a GradBuffer (unit tests),
`p.grad` is used.

Gradient norm under TP x DP: after the DP all-reduce every DP rank holds the same gradients, so
only TP matters. A TP-sharded parameter contributes its shard's squared norm on each TP rank
(summed over the TP group); a replicated parameter has identical gradients on every TP rank and
is counted once, so ||g||^2 = allreduce_TP(sum_sharded ||g_i||^2) + sum_replicated ||g_j||^2.

Clip groups: the parameters of a `param_options` prefix that gives `clip_grad` are clipped by the norm of their own
gradients to that max (tianweiy/DMD2 clips its guidance model, GAN head included, apart from the generator); all
other parameters by the norm of theirs to `--clip-grad`. Each group's norm follows the rule above (its own TP split),
all groups' sharded squares in one TP all-reduce. The norm `step` returns, and the non-finite check reads, is the
global one, sqrt(sum of the groups' squares). With no clip group the step is that of before: one norm, one multiply.

`--bf16`: the model's parameters are bf16; `Optimizer` keeps fp32 master weights and Adam state. The
masters' `.grad` ARE the fp32 main_grads (no per-step upcast), and the update is copied back to the
bf16 parameters with one foreach copy.

Learning rate: with torch's fused AdamW each group's lr is a persistent 0-dim fp32 tensor on the parameters' device
(`g["lr"]`), which `LRSchedule.apply` fills in place (no host sync, no new object per cycle: what a captured step
needs); the kernel reads it as fp32, so the lr applied is lr rounded to fp32. Checkpoints hold it as a float
(`state_dict`), as before, and a loaded float (or tensor) is written back into the persistent tensor. apex FusedAdam
takes a float lr.

Non-finite guard: a step whose gradient norm (or the loss passed to `step`) is NaN or inf is
skipped: weights and Adam moments / step counts stay exactly as they were. The decision stays on the
device (the found-inf input of torch's fused AdamW, as GradScaler uses it): no host sync. Under DP the
flag is all-reduced (MAX) over the DP group first, so all ranks skip together (the norm is already
identical on every rank; the loss is per DP rank). The skip counters are device tensors too; reading
`skipped_steps` / `consecutive_skips` syncs, so the training loop reads them once per iteration,
together with the exit check (`loop.train_loop`). apex FusedAdam has no found-inf input: with it, the
decision costs one host sync per step.
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, replace
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from dmd2_mega.config import OptimConfig
from dmd2_mega.errors import ConfigError
from dmd2_mega.train.flat import FlatAdamState, flat_copies
from dmd2_mega.train.grad_buffer import GradBuffer
from dmd2_mega.distributed.parallel import tp_partition_dim


OPTION_KEYS = ("lr_mult", "weight_decay", "clip_grad")
"""What a model's `param_options()` may set for the parameters under a name prefix (every key optional)."""


def param_options(model: torch.nn.Module) -> dict:
    """`model.param_options()` -> {name prefix: {"lr_mult": float, "weight_decay": float, "clip_grad": float}}, or {}
    for a model without it; prefixes with no option are left out (their parameters are the others'). A parameter
    takes the options of the first prefix its name starts with."""
    options = model.param_options() if hasattr(model, "param_options") else {}
    for prefix, o in options.items():
        unknown = sorted(set(o) - set(OPTION_KEYS))
        if unknown:
            raise ValueError(f"{type(model).__name__}.param_options()[{prefix!r}] has unknown keys {unknown}; "
                             f"allowed: {', '.join(OPTION_KEYS)}")
    return {prefix: o for prefix, o in options.items() if o}


def _prefix_of(name: str, options: dict) -> Optional[str]:
    return next((prefix for prefix in options if name.startswith(prefix)), None)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """[decayed, not decayed (biases, norms, embedding tables)], then the groups of each `param_options` prefix (in
    the order its parameters come): its own lr multiplier (`lr_mult`, which `LRSchedule.apply` reads) and, where it
    gives `weight_decay`, one group decayed by it, biases and norms included (tianweiy/DMD2's guidance AdamW decays
    all its parameters); else the same split as the others'. A model without options gets the two groups of before
    (its checkpoints load as before)."""
    options = param_options(model)
    groups: dict = {(None, True): [], (None, False): []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        prefix = _prefix_of(name, options)
        own_decay = "weight_decay" in options.get(prefix, {})
        decay = None if own_decay else not (p.ndim < 2 or name.endswith("table.weight"))
        groups.setdefault((prefix, decay), []).append(p)
    return [_group(params, options.get(prefix, {}), weight_decay, decay) for (prefix, decay), params in groups.items()]


def _group(params: list, options: dict, weight_decay: float, decay: Optional[bool]) -> dict:
    """One optimizer group: `decay` None = the prefix's own weight decay on all its parameters."""
    wd = float(options["weight_decay"]) if decay is None else (weight_decay if decay else 0.0)
    mult = float(options.get("lr_mult", 1.0))
    return {"params": params, "weight_decay": wd, **({"lr_mult": mult} if mult != 1.0 else {})}


def clip_groups(model: torch.nn.Module, params: list, clip_grad: float) -> tuple[list[float], list[int]]:
    """(max norms, group of each of `params`): group 0 = the parameters clipped to `clip_grad` (--clip-grad); group
    k >= 1 = those of the k-th `param_options` prefix giving `clip_grad` (in the order its parameters come), clipped
    by their own norm to it. A max of 0 leaves the group unclipped. Without such a prefix: ([clip_grad], all 0)."""
    options = param_options(model)
    names = {id(p): name for name, p in model.named_parameters()}
    maxes, index, ids = [float(clip_grad)], {}, []
    for p in params:
        prefix = _prefix_of(names[id(p)], options)
        if prefix is None or "clip_grad" not in options[prefix]:
            ids.append(0)
            continue
        if prefix not in index:
            index[prefix] = len(maxes)
            maxes.append(float(options[prefix]["clip_grad"]))
        ids.append(index[prefix])
    return maxes, ids


GROUP_FLAGS = "--dmd2-gan-head-lr-mult, --dmd2-gan-head-weight-decay or --dmd2-gan-head-clip-grad"
"""The flags that give a model's `param_options`, so change the optimizer's group count."""


def check_group_count(saved_groups: list, groups: list) -> None:
    """Before loading a saved optimizer state: a group count other than this run's is a parameter option set on one
    side only (`param_groups`), a clear error."""
    if len(saved_groups) != len(groups):
        raise ValueError(f"the optimizer state has {len(saved_groups)} parameter groups, this run {len(groups)}: a "
                         f"parameter group option ({GROUP_FLAGS}) was set in one run only; give the saved run's "
                         f"values or pass --no-load-optim")


def keep_lr_mults(groups: list, mults: list) -> None:
    """After loading a saved optimizer state into `groups`: the run's own multipliers `mults` stand (the saved
    state's are the old run's)."""
    for g, m in zip(groups, mults):
        g.pop("lr_mult", None)
        g.update({"lr_mult": m} if m is not None else {})


def keep_weight_decays(groups: list, decays: list) -> None:
    """After loading a saved optimizer state into `groups`: the run's own weight decay per group stands (torch's
    load takes the saved run's), as Megatron's scheduler sets it from the run's flags each step."""
    for g, wd in zip(groups, decays):
        g["weight_decay"] = wd


def _inner_optimizer(groups: list, cfg: OptimConfig, on_cuda: bool) -> torch.optim.Optimizer:
    kw = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    if cfg.optimizer_impl == "apex":
        if importlib.util.find_spec("apex") is None:
            raise ConfigError("--optimizer-impl apex needs the apex package, which is not installed "
                              "(use --optimizer-impl torch)")
        if not on_cuda:
            raise ConfigError("--optimizer-impl apex needs CUDA; use --optimizer-impl torch on CPU")
        from apex.optimizers import FusedAdam
        return FusedAdam(groups, adam_w_mode=True, **kw)
    return torch.optim.AdamW(groups, fused=True, **kw)


def device_lrs(groups: list, device: torch.device) -> list[torch.Tensor]:
    """Put each group's lr into a persistent 0-dim fp32 tensor on `device` (torch's fused AdamW reads it there; module
    docstring) and return those tensors."""
    lrs = [torch.full((), float(g["lr"]), dtype=torch.float32, device=device) for g in groups]
    for g, lr in zip(groups, lrs):
        g["lr"] = lr
    return lrs


def restore_lrs(groups: list, lrs: list) -> None:
    """After a saved state was loaded into `groups` (its lr a float, or a tensor): the persistent lr tensors back in
    the groups, holding the saved values."""
    for g, lr in zip(groups, lrs):
        lr.fill_(float(g["lr"]))
        g["lr"] = lr


def groups_to_save(groups: list) -> list:
    """The groups of an optimizer state dict with each lr as a float (the checkpoint format; a host sync per group)."""
    return [{**g, "lr": float(g["lr"])} if torch.is_tensor(g["lr"]) else g for g in groups]


@dataclass
class ClipGroup:
    """Parameters clipped together: by the norm of their own gradients to `max_norm` (0 = no clip). `params`: the
    stepped (master) parameters; with a GradBuffer, `split` (their `split_by_tp` lists) and `views` (the buffer slices
    holding their gradients, adjacent ones merged) are fixed for the optimizer's life."""
    max_norm: float
    params: list
    split: Optional[tuple] = None
    views: Optional[list] = None

    def clip(self, norm: torch.Tensor, tp_group=None) -> None:
        """Scale the group's gradients by clip_coefficient(norm): one multiply per buffer view (one of the whole
        buffer when this is the only group, padding 0), else `clip_gradients` over `.grad`."""
        if self.max_norm <= 0:
            return
        if self.views is None:
            clip_gradients(self.params, self.max_norm, tp_group, norm=norm)
        elif len(self.views) == 1:
            self.views[0].mul_(clip_coefficient(norm, self.max_norm))
        elif self.views:
            torch._foreach_mul_(self.views, clip_coefficient(norm, self.max_norm))


def buffer_views(grads: GradBuffer, params: list) -> list[torch.Tensor]:
    """The slices of `grads.buffer` holding `params`' main_grads, adjacent ones merged (a module's parameters are
    one run: a prefix's group is a slice or two, not a tensor per parameter)."""
    index = {id(p): i for i, p in enumerate(grads.params)}
    runs: list[list[int]] = []
    for start, n in sorted((grads.offsets[index[id(p)]], p.numel()) for p in params):
        if runs and runs[-1][1] == start:
            runs[-1][1] = start + n
        else:
            runs.append([start, start + n])
    return [grads.buffer[a:b] for a, b in runs]


class Optimizer:
    """AdamW + global-norm clipping (per clip group: `clip_groups`), with fp32 master weights when the model is bf16.

    fp32 model: AdamW steps the model's parameters directly. bf16 model (`--bf16`): each
    parameter has an fp32 master copy (carrying the TP attributes); `step` clips and steps the
    masters in fp32 and writes them back rounded to bf16, Megatron's mixed-precision optimizer in a
    few lines. `grads`: the model's GradBuffer (fp32 main_grads, DP reduction), or None to read
    `p.grad`. `step` returns the grad norm before clipping (a device tensor) and skips the update on
    the device when the norm or the loss is not finite (module docstring).
    """

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, tp_group=None, dp_group=None,
                 grads: Optional[GradBuffer] = None):
        self.cfg, self.tp_group, self.dp_group, self.grads = cfg, tp_group, dp_group, grads
        groups = param_groups(model, cfg.weight_decay)
        self.model_params = [p for g in groups for p in g["params"]]
        self.mixed = any(p.dtype in (torch.bfloat16, torch.float16) for p in self.model_params)
        if self.mixed:  # the fp32 masters, views of one buffer (`flat`)
            masters = iter(flat_copies(self.model_params, torch.float32))
            for g in groups:
                g["params"] = [self._master(p, next(masters)) for p in g["params"]]
        self.master_params = [p for g in groups for p in g["params"]]
        if grads is not None and self.mixed:  # the stepped grads are the fp32 main_grads, for good (grad_buffer)
            for p, m in zip(self.model_params, self.master_params):
                m.grad = p.main_grad
        self._clip = self._clip_groups(model)
        self.lr_mults = [g.get("lr_mult") for g in groups]
        self.weight_decays = [g["weight_decay"] for g in groups]
        self.inner = _inner_optimizer(groups, cfg, self.model_params[0].is_cuda)
        self.device_skips = self.inner.__class__ is torch.optim.AdamW  # fused AdamW takes found_inf
        self._flat = FlatAdamState(self.inner) if self.device_skips else None  # its state in two buffers
        dev = self.model_params[0].device
        self._lrs = device_lrs(self.inner.param_groups, dev) if self.device_skips else []
        self._skipped = torch.zeros((), dtype=torch.int64, device=dev)
        self._consecutive = torch.zeros((), dtype=torch.int64, device=dev)

    @staticmethod
    def _master(p: torch.nn.Parameter, data: torch.Tensor) -> torch.nn.Parameter:
        """p's fp32 master over `data` (p's value in fp32), with p's TP attributes."""
        m = torch.nn.Parameter(data)
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(p, attr):
                setattr(m, attr, getattr(p, attr))
        return m

    def _clip_groups(self, model: torch.nn.Module) -> list[ClipGroup]:
        """The clip groups (`clip_groups`) over the masters; with a GradBuffer their norm lists and buffer views, made
        once (the whole buffer when there is one group: the multiply of before)."""
        maxes, ids = clip_groups(model, self.model_params, self.cfg.clip_grad)
        out = []
        for k, max_norm in enumerate(maxes):
            members = [j for j, i in enumerate(ids) if i == k]
            masters = [self.master_params[j] for j in members]
            group = ClipGroup(max_norm, masters)
            if self.grads is not None:
                group.split = split_by_tp(masters)
                group.views = ([self.grads.buffer] if len(maxes) == 1 else
                               buffer_views(self.grads, [self.model_params[j] for j in members]))
            out.append(group)
        return out

    @property
    def param_groups(self):
        return self.inner.param_groups

    # ---- skip counters (device tensors; reading one as an int is a host sync) ----------------------
    @property
    def skip_counters(self) -> torch.Tensor:
        """[2] int64 on the device: steps skipped since this object was built (not checkpointed), and
        skipped steps since the last applied one."""
        return torch.stack([self._skipped, self._consecutive])

    @property
    def skipped_steps(self) -> int:
        return int(self._skipped.item())

    @property
    def consecutive_skips(self) -> int:
        return int(self._consecutive.item())

    def _non_finite(self, norm: torch.Tensor, loss: Optional[torch.Tensor]) -> torch.Tensor:
        """A device bool []: the norm or loss is NaN/inf on any DP rank. One test of their sum: s * 0 is NaN exactly
        when s = norm + loss is NaN or +-inf, which it is when either is (inf - inf is NaN); two launches, where
        `~isfinite(norm) | ~isfinite(loss)` costs eleven. (Two finite values whose sum overflows, both above
        1.7e38, count as non-finite too.)"""
        total = norm
        if loss is not None:
            loss = loss.detach().float()
            total = norm + (loss.sum() if loss.dim() else loss).to(norm.device)
        bad = torch.isnan(total * 0)
        if self.dp_group is not None and dist.is_initialized() and dist.get_world_size(self.dp_group) > 1:
            flag = bad.to(torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.dp_group)
            bad = flag > 0
        return bad

    def _gather_grads(self) -> None:
        """Complete this step's gradients: the GradBuffer's reduction, or (no GradBuffer, bf16) the masters' grads."""
        if self.grads is not None:
            self.grads.finish()
        elif self.mixed:
            for p, m in zip(self.model_params, self.master_params):
                m.grad = None if p.grad is None else p.grad.float()

    def step(self, loss: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Clip and step unless the grad norm or `loss` is non-finite; returns the norm before clipping."""
        self._gather_grads()
        return self._step(loss)

    def _step(self, loss: Optional[torch.Tensor]) -> torch.Tensor:
        norm, group_norms = self._norms()
        bad = self._non_finite(norm, loss)
        self._skipped += bad
        self._consecutive = (self._consecutive + 1) * bad
        if not self.device_skips and bool(bad.item()):  # apex: the one host sync of a step
            return norm
        for group, group_norm in zip(self._clip, group_norms):
            group.clip(group_norm, self.tp_group)
        if self.device_skips:
            self.inner.found_inf = bad.float()  # 1: the fused kernel leaves params, moments and steps as they are
        self.inner.step()
        self.copy_to_model()
        return norm

    def _norms(self) -> tuple[torch.Tensor, list]:
        """(the global norm, each clip group's norm): one `tp_norm` when there is one group (the step of before;
        with a GradBuffer and no TP, the whole buffer's norm in one launch: its elements are the gradients and zero
        padding), else each group's squares (`tp_squares`) and the global norm their sum's root."""
        if len(self._clip) == 1 and self.grads is not None and tp_world_size(self.tp_group) == 1:
            norm = torch.linalg.vector_norm(self.grads.buffer)
            return norm, [norm]
        splits = [g.split if g.split is not None else split_by_tp(g.params) for g in self._clip]
        if len(splits) == 1:
            norm = tp_norm(*splits[0], self.tp_group)
            return norm, [norm]
        squares = tp_squares(splits, self.tp_group)
        return squares.sum().sqrt(), list(squares.sqrt().unbind())

    rebuilds_model = True
    """`copy_to_model` rebuilds the bf16 parameters from this rank's masters alone (the distributed optimizer's are
    shards: it cannot, so a time-sliced role under it copies its weights)."""

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """bf16 model: its parameters = the fp32 masters rounded (after each step; and what a waking role rebuilds its
        weights from instead of copying them, `offload.Sleeper`'s derived weights). fp32: nothing (they are one)."""
        if self.mixed:
            torch._foreach_copy_(self.model_params, self.master_params)

    @torch.no_grad()
    def sync_masters(self) -> None:
        """Copy the model's weights into the fp32 masters (after weights were loaded into the model behind the
        optimizer's back, e.g. --load with --no-load-optim; else the first step would restore the old weights)."""
        if self.mixed:
            torch._foreach_copy_(self.master_params, self.model_params)

    def zero_grad(self) -> None:
        """Zero the gradients: one kernel over the GradBuffer (whose views stay the `.grad`), else `.grad = None`."""
        if self.grads is not None:
            self.grads.zero()
            return
        for p in self.model_params:
            p.grad = None
        if self.mixed:
            for m in self.master_params:
                m.grad = None

    def state_dict(self) -> dict:
        inner = self.inner.state_dict()
        state = {"inner": {**inner, "param_groups": groups_to_save(inner["param_groups"])}, "mixed": self.mixed}
        if self.mixed:
            state["master"] = [m.detach().clone() for m in self.master_params]
        return state

    def load_state_dict(self, state: dict) -> None:
        if bool(state.get("mixed")) != self.mixed:
            raise ValueError(f"optimizer state was saved {'with' if state.get('mixed') else 'without'} --bf16 "
                             f"but this run is {'with' if self.mixed else 'without'} it; pass --no-load-optim")
        check_group_count(state["inner"]["param_groups"], self.inner.param_groups)
        self.inner.load_state_dict(state["inner"])
        if self._flat is not None:
            self._flat.repack(self.inner)
        restore_lrs(self.inner.param_groups, self._lrs)
        keep_lr_mults(self.inner.param_groups, self.lr_mults)
        keep_weight_decays(self.inner.param_groups, self.weight_decays)
        if self.mixed:
            with torch.no_grad():
                for m, saved in zip(self.master_params, state["master"]):
                    m.copy_(saved)
                torch._foreach_copy_(self.model_params, self.master_params)


def step_optimizer(optimizer, loss: torch.Tensor) -> torch.Tensor:
    """`optimizer.step(loss)` for an `Optimizer` (the loss joins the non-finite check); any other
    object with a plain `.step()` (e.g. the phase tests' recording wrappers) is stepped without it."""
    return optimizer.step(loss) if isinstance(optimizer, Optimizer) else optimizer.step()


class LRSchedule:
    """lr(it): linear warmup 0 -> lr over `lr_warmup_iters`, then cosine to `min_lr` at
    `lr_decay_iters` (default train_iters) or constant. A pure function of the iteration."""

    def __init__(self, cfg: OptimConfig, train_iters: int):
        self.cfg = cfg
        self.decay_iters = cfg.lr_decay_iters or max(train_iters, 1)

    def __call__(self, it: int) -> float:
        c = self.cfg
        if c.lr_warmup_iters and it < c.lr_warmup_iters:
            return c.lr * (it + 1) / c.lr_warmup_iters
        if c.lr_decay_style == "constant":
            return c.lr
        span = max(self.decay_iters - c.lr_warmup_iters, 1)
        frac = min(max(it - c.lr_warmup_iters, 0) / span, 1.0)
        return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1 + math.cos(math.pi * frac))

    def apply(self, optimizer: torch.optim.Optimizer, it: int) -> float:
        """Set lr(it) (times a group's `lr_mult`) into every group: filled into its lr tensor where it has one
        (`Optimizer`'s fused AdamW: no host sync, the same tensor every cycle), else set as a float. Returns lr(it)."""
        lr = self(it)
        for g in optimizer.param_groups:
            value = lr * g.get("lr_mult", 1.0)
            if torch.is_tensor(g["lr"]):
                g["lr"].fill_(value)
            else:
                g["lr"] = value
        return lr

    def state_dict(self) -> dict:
        """Everything lr(it) depends on (the schedule itself is a pure function of the iteration)."""
        c = self.cfg
        return {"decay_iters": self.decay_iters, "style": c.lr_decay_style, "lr": c.lr, "min_lr": c.min_lr,
                "warmup_iters": c.lr_warmup_iters}

    def mismatches(self, state: dict) -> list:
        """[(key, saved, now)] for every schedule value of a saved `state` that differs from this one's
        (keys an older checkpoint lacks are not compared; with a constant schedule on both sides the
        decay length and the floor do not matter)."""
        now = self.state_dict()
        moot = ("decay_iters", "min_lr") if state.get("style") == now["style"] == "constant" else ()
        return [(k, state[k], now[k]) for k in now if k in state and k not in moot and state[k] != now[k]]

    def load_state_dict(self, state: dict) -> None:
        """Take the checkpoint's schedule (Megatron's --use-checkpoint-opt-param-scheduler)."""
        self.cfg = replace(self.cfg, lr=state["lr"], lr_decay_style=state["style"],
                           min_lr=state.get("min_lr", self.cfg.min_lr),
                           lr_warmup_iters=state.get("warmup_iters", self.cfg.lr_warmup_iters))
        self.decay_iters = state["decay_iters"]


def split_by_tp(params: Iterable[torch.nn.Parameter]) -> tuple[list, list]:
    """([grads of TP-sharded params], [grads of replicated params]), params without a grad left out."""
    params = [p for p in params if p.grad is not None]
    return ([p.grad for p in params if tp_partition_dim(p) is not None],
            [p.grad for p in params if tp_partition_dim(p) is None])


def sum_squares(gs: list, dev) -> torch.Tensor:
    """Sum of squared per-tensor norms: one foreach launch, not two kernels per tensor (fp32 [])."""
    if not gs:
        return torch.zeros((), device=dev, dtype=torch.float32)
    return torch.stack(torch._foreach_norm(gs)).float().square().sum()


def tp_world_size(tp_group) -> int:
    return dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1


def tp_norm(sharded: list, replicated: list, tp_group=None) -> torch.Tensor:
    """Global L2 norm of gradients split by `split_by_tp` (fp32 tensor, no host sync); see module docstring."""
    if not sharded and not replicated:
        return torch.zeros(())
    dev = (sharded or replicated)[0].device
    s = sum_squares(sharded, dev)
    if tp_world_size(tp_group) > 1:
        dist.all_reduce(s, group=tp_group)
    return (s + sum_squares(replicated, dev)).sqrt()


def tp_squares(splits: list, tp_group=None) -> torch.Tensor:
    """[G] fp32: the squared L2 norm of each group of gradients, `splits` [(sharded, replicated)] by `split_by_tp`,
    under `tp_norm`'s rule; the groups' sharded squares in one TP all-reduce (no host sync)."""
    dev = next((t.device for s, r in splits for t in (*s, *r)), torch.device("cpu"))
    sharded = torch.stack([sum_squares(s, dev) for s, _ in splits])
    if tp_world_size(tp_group) > 1:
        dist.all_reduce(sharded, group=tp_group)
    return sharded + torch.stack([sum_squares(r, dev) for _, r in splits])


def grad_norm(params: Iterable[torch.nn.Parameter], tp_group=None) -> torch.Tensor:
    """Global L2 norm of the gradients (fp32 tensor, no host sync); see module docstring."""
    return tp_norm(*split_by_tp(params), tp_group)


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)): the factor that brings the global norm to at most `max_norm` (on the
    device)."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def clip_gradients(params: list, max_norm: float, tp_group=None,
                   norm: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm` (0 = no clip); returns the
    norm before clipping (`norm`, if already computed). The scale is a device tensor: no host sync."""
    norm = grad_norm(params, tp_group) if norm is None else norm
    if max_norm > 0:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            coef = clip_coefficient(norm, max_norm)
            torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm
