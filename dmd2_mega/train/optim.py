"""Optimizer, LR schedule and TP/DP-correct gradient clipping, written thinly over torch.

megatron-core's optimizer needs CUDA and does not keep Adam's step count across a resume, so
the optimizer is torch's fused AdamW (its multi-tensor kernel, on CUDA and on CPU) or apex FusedAdam
(`--optimizer-impl apex`), with two parameter groups: weight decay on matrices, none on biases, norms and
embedding tables.

Gradients: with a `grad_buffer.GradBuffer` (both trainers attach one) they arrive in the fp32 `main_grad`
views of one flat buffer, accumulated (by autograd: they are the parameters' `.grad`) and DP-reduced in fp32
(Megatron's scheme); `step` first completes that reduction. The tensors the step reads are then fixed for the
optimizer's life, so the step has no Python loop over parameters: the norm's foreach lists are made once, the clip
is one multiply of the buffer, `zero_grad` one zero of it. Without a GradBuffer (unit tests), `p.grad` is used.

Gradient norm under TP x DP: after the DP all-reduce every DP rank holds the same gradients, so
only TP matters. A TP-sharded parameter contributes its shard's squared norm on each TP rank
(summed over the TP group); a replicated parameter has identical gradients on every TP rank and
is counted once, so ||g||^2 = allreduce_TP(sum_sharded ||g_i||^2) + sum_replicated ||g_j||^2.

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
from dataclasses import replace
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from dmd2_mega.config import OptimConfig
from dmd2_mega.errors import ConfigError
from dmd2_mega.train.flat import FlatAdamState, flat_copies
from dmd2_mega.train.grad_buffer import GradBuffer
from dmd2_mega.distributed.parallel import tp_partition_dim


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """[decayed, not decayed (biases, norms, embedding tables)] and, for the parameters whose learning rate the
    model scales (`model.lr_mults()` -> {name prefix: multiplier}, e.g. the GAN critic's fresh head), a group of
    their own per (multiplier, decay) carrying `lr_mult`, which `LRSchedule.apply` reads."""
    mults = model.lr_mults() if hasattr(model, "lr_mults") else {}
    groups: dict = {(1.0, True): [], (1.0, False): []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = not (p.ndim < 2 or name.endswith("table.weight"))
        mult = next((float(m) for prefix, m in mults.items() if name.startswith(prefix)), 1.0)
        groups.setdefault((mult, decay), []).append(p)
    return [{"params": params, "weight_decay": weight_decay if decay else 0.0, **({"lr_mult": m} if m != 1.0 else {})}
            for (m, decay), params in groups.items()]


def check_group_count(saved_groups: list, groups: list) -> None:
    """Before loading a saved optimizer state: a group count other than this run's is a learning-rate multiplier set
    on one side only (`param_groups`), a clear error."""
    if len(saved_groups) != len(groups):
        raise ValueError(f"the optimizer state has {len(saved_groups)} parameter groups, this run {len(groups)}: a "
                         f"learning-rate multiplier (--dmd2-gan-head-lr-mult) was set in one run only; give the "
                         f"saved run's value or pass --no-load-optim")


def keep_lr_mults(groups: list, mults: list) -> None:
    """After loading a saved optimizer state into `groups`: the run's own multipliers `mults` stand (the saved
    state's are the old run's)."""
    for g, m in zip(groups, mults):
        g.pop("lr_mult", None)
        g.update({"lr_mult": m} if m is not None else {})


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


class Optimizer:
    """AdamW + global-norm clipping, with fp32 master weights when the model is bf16.

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
        self._fixed = None
        if grads is not None:  # the stepped grads are the fp32 main_grads, for good (grad_buffer)
            if self.mixed:
                for p, m in zip(self.model_params, self.master_params):
                    m.grad = p.main_grad
            self._fixed = split_by_tp(self.master_params)
        self.lr_mults = [g.get("lr_mult") for g in groups]
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
        """A device bool []: the norm or loss is NaN/inf on any DP rank."""
        bad = ~torch.isfinite(norm)
        if loss is not None:
            bad = bad | ~torch.isfinite(loss.detach().float().sum()).to(norm.device)
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
        sharded, replicated = self._fixed or split_by_tp(self.master_params)
        norm = tp_norm(sharded, replicated, self.tp_group)
        bad = self._non_finite(norm, loss)
        self._skipped += bad
        self._consecutive = (self._consecutive + 1) * bad
        if not self.device_skips and bool(bad.item()):  # apex: the one host sync of a step
            return norm
        if self._fixed is not None:  # every stepped grad is in the buffer: one multiply (padding is 0)
            if self.cfg.clip_grad > 0:
                self.grads.buffer.mul_(clip_coefficient(norm, self.cfg.clip_grad))
        else:
            clip_gradients(self.master_params, self.cfg.clip_grad, self.tp_group, norm=norm)
        if self.device_skips:
            self.inner.found_inf = bad.float()  # 1: the fused kernel leaves params, moments and steps as they are
        self.inner.step()
        self.copy_to_model()
        return norm

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


def tp_norm(sharded: list, replicated: list, tp_group=None) -> torch.Tensor:
    """Global L2 norm of gradients split by `split_by_tp` (fp32 tensor, no host sync); see module docstring."""
    if not sharded and not replicated:
        return torch.zeros(())
    dev = (sharded or replicated)[0].device

    def sq(gs):  # sum of squared per-tensor norms: one foreach launch, not two kernels per tensor
        if not gs:
            return torch.zeros((), device=dev, dtype=torch.float32)
        return torch.stack(torch._foreach_norm(gs)).float().square().sum()

    s = sq(sharded)
    if tp_group is not None and dist.is_initialized() and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(s, group=tp_group)
    return (s + sq(replicated)).sqrt()


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
