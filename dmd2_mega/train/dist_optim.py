"""The distributed optimizer (`--use-distributed-optimizer`): fp32 master weights, reduced gradients and Adam
state sharded over the DP group (ZeRO-1/2 with Megatron's semantics), for every trained role.

Why not megatron-core's `DistributedOptimizer`: it is built on the param-and-grad buffers of megatron-core's
`DistributedDataParallel` wrapper (`per_model_buffers`), which our trainers replace by `grad_buffer.GradBuffer`,
and it accepts only `torch.cuda.*Tensor` parameters (its `_build_model_and_main_param_groups` raises for any
other type), so it cannot run on a CPU build at all. This is the same scheme, small, on our buffer:

    GradBuffer(shard=True): every bucket is padded to a multiple of DP and cut into DP equal shards; the DP
        reduction is an in-place reduce-scatter, so rank r receives the DP-mean gradient of its shards only.
    Here: rank r owns the parameter fragments that fall in its shards. Each fragment has an fp32 master
        (the only fp32 weights; the model's own fp32 parameters are not stepped in place) and AdamW state;
        torch's fused AdamW steps the fragments, whose `.grad` are views of the reduced shard.
    After the step, each bucket's updated masters are written into a transient flat buffer of the model's
        dtype (one `cat` of this rank's fragments into its shard) and all-gathered over DP (`all_gather_single`
        in place), then copied into the parameters (one foreach copy).
The lists a step reads (fragment grads, the norm's) are made once; the lr is a device tensor (`optim`'s docstring).

Per rank this keeps 1/DP of the master weights and Adam state (12 bytes per parameter / DP instead of 12,
or 8 / DP instead of 8 for an fp32 model). The full fp32 gradient buffer stays (gradient accumulation over
micro-batches needs it), as in Megatron.

Gradient norm: each rank sums the squares of its fragments' gradients, split into TP-sharded and replicated
parameters (`optim.grad_norm`'s rule); the pair is all-reduced over DP, the sharded part then over TP. The
clip coefficient and the non-finite skip are therefore the same on every rank. With clip groups
(`optim.clip_groups`: a `param_options` prefix giving `clip_grad`) there is such a pair per group, all in the same
two all-reduces, and each group's fragments are scaled by its own coefficient; the norm returned is the global one
(optim's docstring). Without clipping the step is bit-identical to `optim.Optimizer` on the same reduced gradients
(AdamW is elementwise); with clipping the norm's summation order differs, so the result agrees to fp32 rounding.

Checkpoints: `state_dict()` is collective over DP. It gathers each bucket's master and moment shards
(`all_gather_single`, one bucket at a time) and returns exactly `optim.Optimizer`'s format (torch
AdamW's per-parameter state, plus the fp32 masters under --bf16), on the CPU. The state therefore does not
depend on DP: it resumes at any DP size, with or without the distributed optimizer; `load_state_dict` takes
this rank's fragments of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from dmd2_mega.config import OptimConfig
from dmd2_mega.errors import ConfigError
from dmd2_mega.train.grad_buffer import GradBuffer
from dmd2_mega.train.optim import (Optimizer, check_group_count, clip_coefficient, clip_groups, device_lrs,
                                   groups_to_save, keep_lr_mults, keep_weight_decays, param_groups, restore_lrs,
                                   sum_squares, tp_world_size)
from dmd2_mega.distributed.parallel import any_rank, tp_partition_dim

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class Fragment:
    """The part of parameter `index` (in `Optimizer.model_params` order) that this rank owns: elements
    [start, start + size) of the flattened parameter, at `buffer_offset` in the GradBuffer."""
    index: int
    start: int
    size: int
    buffer_offset: int
    bucket: int


class DistributedOptimizer(Optimizer):
    """AdamW on this DP rank's fragments (module docstring). `grads` must be a GradBuffer built with
    `shard=True` over `dp_group`."""

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, tp_group=None, dp_group=None,
                 grads: Optional[GradBuffer] = None):
        if grads is None or not grads.shard:
            raise ValueError("DistributedOptimizer needs the model's GradBuffer built with shard=True")
        if cfg.optimizer_impl != "torch":
            raise ConfigError(f"--use-distributed-optimizer steps with torch's fused AdamW; --optimizer-impl "
                              f"{cfg.optimizer_impl} is not supported with it (use --optimizer-impl torch)")
        self.cfg, self.tp_group, self.dp_group, self.grads = cfg, tp_group, dp_group, grads
        groups = param_groups(model, cfg.weight_decay)
        self.model_params = [p for g in groups for p in g["params"]]
        self._group_sizes = [len(g["params"]) for g in groups]
        self.lr_mults = [g.get("lr_mult") for g in groups]
        self.weight_decays = [g["weight_decay"] for g in groups]
        self.mixed = any(p.dtype in (torch.bfloat16, torch.float16) for p in self.model_params)
        self._index = {id(p): j for j, p in enumerate(self.model_params)}
        buffer_index = {id(p): i for i, p in enumerate(grads.params)}
        missing = [tuple(p.shape) for p in self.model_params if id(p) not in buffer_index]
        if missing:
            raise ValueError(f"DistributedOptimizer: parameters {missing} are not in the GradBuffer")
        self.fragments: list[Fragment] = []
        self.master_params: list[torch.nn.Parameter] = []
        """This rank's fp32 master fragments, one per `fragments` entry (the inner AdamW's parameters)."""
        inner_groups = []
        for g in groups:
            params = []
            for p in g["params"]:
                frag = self._own_fragment(p, buffer_index[id(p)])
                if frag is None:
                    continue
                master = torch.nn.Parameter(p.detach().reshape(-1)[frag.start:frag.start + frag.size].float().clone())
                master.grad = grads.buffer[frag.buffer_offset:frag.buffer_offset + frag.size]
                master.sharded = tp_partition_dim(p) is not None  # for the norm: TP-sharded or replicated
                self.fragments.append(frag)
                self.master_params.append(master)
                params.append(master)
            inner_groups.append({**g, "params": params})
        self.inner = torch.optim.AdamW(inner_groups, fused=True, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                       eps=cfg.adam_eps)
        self.device_skips = True
        self._dev = self.model_params[0].device
        self._lrs = device_lrs(self.inner.param_groups, self._dev)
        # fixed for the optimizer's life (views of the GradBuffer): the step's lists are made once
        self._frag_grads = [m.grad for m in self.master_params]
        self._clip_maxes, ids = clip_groups(model, self.model_params, cfg.clip_grad)
        group_of = [ids[f.index] for f in self.fragments]
        self._clip_grads = ([self._frag_grads] if len(self._clip_maxes) == 1 else
                            [[g for g, k in zip(self._frag_grads, group_of) if k == i]
                             for i in range(len(self._clip_maxes))])
        """Each clip group's fragment gradients on this rank (maybe none)."""
        self._norm_grads = [[m.grad for m, k in zip(self.master_params, group_of) if m.sharded == s and k == i]
                            for s in (True, False) for i in range(len(self._clip_maxes))]
        """The norm's lists: [TP-sharded of group 0, ..., of group G-1, replicated of group 0, ...]."""
        in_order = sorted(zip(self.fragments, self.master_params), key=lambda fm: fm[0].buffer_offset)
        self._by_bucket = [[m for f, m in in_order if f.bucket == b] for b in range(len(grads.buckets))]
        """This rank's masters per bucket, in buffer order: they tile its shard, but for the padding at the end."""
        self._skipped = torch.zeros((), dtype=torch.int64, device=self._dev)
        self._consecutive = torch.zeros((), dtype=torch.int64, device=self._dev)

    rebuilds_model = False  # its masters are this rank's shards: rebuilding the weights would be an all-gather

    def _own_fragment(self, p: torch.nn.Parameter, i: int) -> Optional[Fragment]:
        """This rank's fragment of GradBuffer parameter i, or None (a parameter lies in one bucket, so a rank
        owns at most one contiguous piece of it)."""
        b = self.grads.bucket_of[i]
        lo, hi = self.grads.shard_range(b)
        off = self.grads.offsets[i]
        start, end = max(off, lo), min(off + p.numel(), hi)
        return Fragment(self._index[id(p)], start - off, end - start, start, b) if end > start else None

    # ---- one step ---------------------------------------------------------------------------------------
    def _gather_grads(self) -> None:
        self.grads.finish()  # the reduce-scatter: each master's .grad (a view of its shard) is now reduced

    def _step(self, loss: Optional[torch.Tensor]) -> torch.Tensor:
        squares = self._grad_squares()
        norm = squares.sum().sqrt()
        n = len(self._clip_maxes)
        group_norms = [norm] if n == 1 else (squares[:n] + squares[n:]).sqrt().unbind()
        bad = self._non_finite(norm, loss)
        self._skipped += bad
        self._consecutive = (self._consecutive + 1) * bad
        for max_norm, grads, group_norm in zip(self._clip_maxes, self._clip_grads, group_norms):
            if max_norm > 0 and grads:
                torch._foreach_mul_(grads, clip_coefficient(group_norm, max_norm))
        if self.master_params:
            self.inner.found_inf = bad.float()  # 1: the fused kernel leaves masters, moments and steps as they are
            self.inner.step()
        self._all_gather_params()
        return norm

    def _grad_squares(self) -> torch.Tensor:
        """[2G]: each clip group's TP-sharded squares, then each one's replicated squares, of the reduced gradients,
        summed over this rank's fragments, all-reduced over DP, the sharded part then over TP (no host sync). The
        global norm is the root of their sum; group i's, that of entries i and G + i."""
        sq = torch.stack([sum_squares(gs, self._dev) for gs in self._norm_grads])
        if self.grads.dp_group is not None:
            dist.all_reduce(sq, group=self.grads.dp_group)
        n = len(self._clip_maxes)
        if tp_world_size(self.tp_group) > 1:
            tp = sq[:n].clone()
            dist.all_reduce(tp, group=self.tp_group)
            sq = torch.cat([tp, sq[n:]])
        return sq

    def _gathered(self, b: int, dtype: torch.dtype, value) -> torch.Tensor:
        """Bucket b's flat [size] tensor of `dtype` holding value(master) at every rank's fragments (each rank
        fills its shard; all-gathered over DP in place)."""
        start, size = self.grads.regions[b]
        lo, hi = self.grads.shard_range(b)
        flat = torch.empty(size, dtype=dtype, device=self._dev)
        shard = flat[lo - start:hi - start]
        owned = [value(m) for m in self._by_bucket[b]]
        n = sum(t.numel() for t in owned)
        if n < shard.numel():  # the bucket's zero padding (at its end, in the last shard)
            owned.append(torch.zeros(shard.numel() - n, dtype=dtype, device=self._dev))
        torch.cat(owned, out=shard)  # one copy (and cast) of this rank's fragments, not one per fragment
        if self.grads.dp_group is not None:
            dist.all_gather_single(flat, flat[lo - start:hi - start], group=self.grads.dp_group)
        return flat

    def _unflatten(self, b: int, flat: torch.Tensor) -> list:
        """[(GradBuffer parameter index, its view in bucket b's flat tensor)]."""
        start, params = self.grads.regions[b][0], self.grads.params
        return [(i, flat[self.grads.offsets[i] - start:self.grads.offsets[i] - start + params[i].numel()]
                 .view(params[i].shape)) for i in self.grads.buckets[b]]

    @torch.no_grad()
    def _all_gather_params(self) -> None:
        """Every rank's updated masters into the model's parameters (in the model's dtype), a bucket at a time."""
        params = self.grads.params
        for b, bucket in enumerate(self.grads.buckets):
            views = self._unflatten(b, self._gathered(b, params[bucket[0]].dtype, lambda m: m))
            torch._foreach_copy_([params[i] for i, _ in views], [v for _, v in views])

    @torch.no_grad()
    def sync_masters(self) -> None:
        """Copy the model's weights into this rank's fp32 master fragments (see `Optimizer.sync_masters`)."""
        for f, m in zip(self.fragments, self.master_params):
            m.copy_(self.model_params[f.index].detach().reshape(-1)[f.start:f.start + f.size])

    def zero_grad(self) -> None:
        """One zero of the GradBuffer (the parameters' `.grad` are its views, for good)."""
        self.grads.zero()

    # ---- checkpoints: optim.Optimizer's format, whatever DP ------------------------------------------------
    @torch.no_grad()
    def state_dict(self) -> dict:
        """Collective over DP: the full state in `optim.Optimizer.state_dict()`'s format, on the CPU."""
        state = self.inner.state
        stepped = any(m in state for m in self.master_params)
        if self.grads.dp_group is not None:  # any DP rank's (one holding only padding has no state)
            stepped = any_rank(stepped, self._dev, self.grads.dp_group)
        kinds = ("master", *MOMENTS) if stepped else ("master",)
        full = {k: [None] * len(self.model_params) for k in kinds}
        for b in range(len(self.grads.buckets)):
            for kind in kinds:
                value = (lambda m: m) if kind == "master" else (lambda m, k=kind: state[m][k])
                for i, v in self._unflatten(b, self._gathered(b, torch.float32, value).cpu()):
                    full[kind][self._index[id(self.grads.params[i])]] = v.clone()
        inner_state = {}
        if stepped:
            step = torch.zeros((), dtype=torch.float32, device=self._dev)
            if self.master_params:
                step = state[self.master_params[0]]["step"].detach().reshape(()).float().clone()
            if self.grads.dp_group is not None:  # a rank whose shards are all padding holds no step
                dist.all_reduce(step, op=dist.ReduceOp.MAX, group=self.grads.dp_group)
            inner_state = {j: {"step": step.cpu().clone(), "exp_avg": full["exp_avg"][j],
                               "exp_avg_sq": full["exp_avg_sq"][j]} for j in range(len(self.model_params))}
        groups, k = [], 0
        for g, n in zip(groups_to_save(self.inner.param_groups), self._group_sizes):
            groups.append({**{key: v for key, v in g.items() if key != "params"}, "params": list(range(k, k + n))})
            k += n
        out = {"inner": {"state": inner_state, "param_groups": groups}, "mixed": self.mixed}
        if self.mixed:
            out["master"] = full["master"]
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """This rank's fragments of a full state (`state_dict`, or `optim.Optimizer`'s at any DP size). The
        masters of an fp32 model are its parameters, which the checkpoint's model weights have already set."""
        if bool(state.get("mixed")) != self.mixed:
            raise ValueError(f"optimizer state was saved {'with' if state.get('mixed') else 'without'} --bf16 "
                             f"but this run is {'with' if self.mixed else 'without'} it; pass --no-load-optim")
        inner = state["inner"]
        saved_groups = inner["param_groups"]
        check_group_count(saved_groups, self.inner.param_groups)
        if [len(g["params"]) for g in saved_groups] != self._group_sizes:
            raise ValueError(f"optimizer state has parameter groups of {[len(g['params']) for g in saved_groups]} "
                             f"parameters; this model has {self._group_sizes}")
        order = [j for g in saved_groups for j in g["params"]]  # saved index of model parameter j (position)
        for g, saved in zip(self.inner.param_groups, saved_groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
        restore_lrs(self.inner.param_groups, self._lrs)
        keep_lr_mults(self.inner.param_groups, self.lr_mults)
        keep_weight_decays(self.inner.param_groups, self.weight_decays)
        self.inner.state.clear()
        self.sync_masters()
        for f, m in zip(self.fragments, self.master_params):
            sl = slice(f.start, f.start + f.size)
            if self.mixed:
                m.copy_(state["master"][f.index].reshape(-1)[sl])
            saved = inner["state"].get(order[f.index])
            if saved is not None:
                self.inner.state[m] = {
                    "step": torch.as_tensor(saved["step"]).reshape(()).to(m.device, torch.float32).clone(),
                    **{k: saved[k].reshape(-1)[sl].to(m.device, torch.float32).clone() for k in MOMENTS}}
        if self.mixed:
            self._all_gather_params()
