#!/usr/bin/env python
"""GradBuffer's accumulation and reductions at 2 ranks (gloo) against a float64 reference and against the
per-parameter hook algorithm of before, re-implemented here (`HookReference`).

    torchrun --standalone --nproc-per-node 2 tests/mp_scripts/grad_buffer_dp.py --out DIR

Each rank runs M = 3 micro-batches of its own data (seeded by rank and j) through a small MLP of odd sizes that also
holds a parameter no forward uses; the first two backwards run under `no_sync()`, then `finish()`. Two rounds (the
buffer zeroed between them). Cases, for an fp32 and a bf16 model each:
  dp       the group is DP = 2, buckets of at most 300 elements (several per model): all-reduced mean
  shard    the same, reduce-scattered (`shard=True`): only this rank's shard of each bucket is compared
  tp       no DP; the group of 2 is the TP group and the MLP's biases are tagged sequence-parallel (summed over TP)
  cp       the group of 2 is DP x CP with DP = 1 (`average_over=1`): the last layer is tagged whole_over_cp (/ CP)
Written to {rank}.json, per case: "exact" (the reduced main_grads bit-equal to the hook algorithm's: per
parameter, main_grad += g after each backward, then the TP all-reduce, / CP, / DP and the DP all-reduce, one
collective per parameter: two ranks' sums do not depend on the layout), "max_rel" (the fp32 model's worst relative
error against the float64 gradient of the global loss, dp case; the float64 sum of the ranks' losses), "buckets",
"unused_zero" (the unused parameter's main_grad stayed 0) and "bound" (every .grad still its main_grad).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dmd2_mega.distributed.parallel import mark_sequence_parallel, mark_whole_over_cp  # noqa: E402
from dmd2_mega.train.grad_buffer import GradBuffer  # noqa: E402

M = 3


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(11, 17)
        self.b = torch.nn.Linear(17, 17)
        self.c = torch.nn.Linear(17, 3)
        self.unused = torch.nn.Parameter(torch.ones(5))

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def data(rank: int, j: int, rnd: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * rnd + 10 * rank + j)
    return torch.randn(6, 11, generator=g).to(dtype), torch.randn(6, 3, generator=g).to(dtype)


def loss_of(net, x, y):
    return ((net(x).float() - y.float()) ** 2).mean()


class HookReference:
    """The algorithm of before: a post-accumulate hook per parameter adds p.grad into an fp32 main_grad and drops it;
    `reduce` then makes one collective per parameter (TP sum, / CP, / DP, DP sum)."""

    def __init__(self, net, dp, tp, cp, average_over):
        self.net, self.dp, self.tp, self.cp, self.average_over = net, dp, tp, cp, average_over
        self.params = [p for p in net.parameters() if p.requires_grad]
        self.main = [torch.zeros(p.shape, dtype=torch.float32) for p in self.params]
        for p, g in zip(self.params, self.main):
            p.register_post_accumulate_grad_hook(self._hook(g))

    @staticmethod
    def _hook(g):
        def add(p):
            g.add_(p.grad)
            p.grad = None
        return add

    def reduce(self):
        for p, g in zip(self.params, self.main):
            if self.tp is not None and getattr(p, "sequence_parallel", False):
                dist.all_reduce(g, group=self.tp)
            if self.cp > 1 and getattr(p, "whole_over_cp", False):
                g.div_(self.cp)
            if self.dp is not None:
                g.div_(self.average_over)
                dist.all_reduce(g, group=self.dp)

    def zero(self):
        for g in self.main:
            g.zero_()


def run_case(case: str, dtype, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    net, ref_net = Net().to(dtype), Net().to(dtype)
    ref_net.load_state_dict(net.state_dict())
    f64 = Net().double()
    f64.load_state_dict({k: v.double() for k, v in net.state_dict().items()})
    for m in (net, ref_net):
        if case == "tp":
            mark_sequence_parallel([m.a.bias, m.b.bias, m.c.bias])
        if case == "cp":
            mark_whole_over_cp(m.c.parameters())
    world_group = dist.group.WORLD
    kw = {"dp": dict(dp_group=world_group), "shard": dict(dp_group=world_group, shard=True),
          "tp": dict(tp_group=world_group), "cp": dict(dp_group=world_group, average_over=1)}[case]
    gb = GradBuffer(net, bucket_elements=300, **kw)
    ref = HookReference(ref_net, None if case == "tp" else world_group, world_group if case == "tp" else None,
                        2 if case == "cp" else 1, 1 if case == "cp" else world)
    exact, worst, unused_zero = True, 0.0, True
    for rnd in range(2):
        for j in range(M):
            batch = data(rank, j, rnd, dtype)
            with gb.no_sync() if j < M - 1 else torch.enable_grad():
                (loss_of(net, *batch) / M).backward()
            (loss_of(ref_net, *batch) / M).backward()
        gb.finish()
        gb.finish()  # a second finish without a backward in between reduces nothing
        ref.reduce()
        want = torch.zeros_like(gb.buffer)
        for i, g in enumerate(ref.main):
            want[gb.offsets[i]:gb.offsets[i] + g.numel()] = g.reshape(-1)
        for b in range(len(gb.buckets)):
            lo, hi = gb.shard_range(b)
            exact = exact and torch.equal(gb.buffer[lo:hi], want[lo:hi])
        if case == "dp" and dtype == torch.float32:
            f64.zero_grad()
            total = sum(loss_of(f64, *(t.double() for t in data(r, j, rnd))) for r in range(world) for j in range(M))
            (total / (world * M)).backward()
            for (name, p), (_, q) in zip(net.named_parameters(), f64.named_parameters()):
                if name != "unused":
                    err = ((p.main_grad.double() - q.grad).abs().max() / q.grad.abs().max()).item()
                    worst = max(worst, err)
        unused_zero = unused_zero and bool((net.unused.main_grad == 0).all())
        gb.zero()
        ref.zero()
    out = {"exact": exact, "max_rel": worst, "buckets": len(gb.buckets), "unused_zero": unused_zero,
           "bound": gb.bound()}
    gb.close()  # drops its reference to the group: a gloo group outliving destroy aborts at exit
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {f"{case}-{name}": run_case(case, dtype, rank, world)
               for case in ("dp", "shard", "tp", "cp") for name, dtype in (("fp32", torch.float32),
                                                                         ("bf16", torch.bfloat16))}
    with open(os.path.join(args.out, f"{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
