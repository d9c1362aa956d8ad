#!/usr/bin/env python
"""GradBuffer's fp32 accumulation and bucketed DP all-reduce against a float64 reference.

    torchrun --standalone --nproc-per-node 2 tests/mp_scripts/grad_buffer_dp.py --out DIR

Each rank runs M = 3 micro-batches of its own data (seeded by rank and j) through a small MLP that also
holds a parameter no forward uses; the first two backwards run under `no_sync()`. Buckets of at most 300
elements (several per model) are launched from the hooks during the last backward. Each rank then compares
every main_grad with the float64 gradient of (1 / DP) sum_r (1 / M) sum_j loss_rj, computed locally on all
ranks' data, twice (the buffer is zeroed between rounds), and writes {rank}.json:
{"max_rel": worst relative error, "launched_in_backward": buckets launched before finish(),
 "buckets": number of buckets, "unused_zero": the unused parameter's main_grad stayed 0}.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dmd2_mega.train.grad_buffer import GradBuffer  # noqa: E402

M = 3


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 16)
        self.b = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(16, 4)
        self.unused = torch.nn.Parameter(torch.ones(5))

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def data(rank: int, j: int, rnd: int):
    g = torch.Generator().manual_seed(1000 * rnd + 10 * rank + j)
    return torch.randn(6, 12, generator=g), torch.randn(6, 4, generator=g)


def loss_of(net, x, y):
    return ((net(x) - y) ** 2).mean()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = Net()
    ref = Net().double()
    ref.load_state_dict({k: v.double() for k, v in net.state_dict().items()})
    gb = GradBuffer(net, dist.group.WORLD, bucket_elements=300)
    worst, launched = 0.0, []
    for rnd in range(2):
        for j in range(M):
            ctx = gb.no_sync() if j < M - 1 else torch.enable_grad()
            with ctx:
                (loss_of(net, *data(rank, j, rnd)) / M).backward()
        launched.append(sum(w is not None for w in gb._work))
        gb.finish()
        ref.zero_grad()
        total = sum(loss_of(ref, *(t.double() for t in data(r, j, rnd))) for r in range(world) for j in range(M))
        (total / (world * M)).backward()
        for (name, p), (_, q) in zip(net.named_parameters(), ref.named_parameters()):
            if name == "unused":
                continue
            err = ((p.main_grad.double() - q.grad).abs().max() / q.grad.abs().max()).item()
            worst = max(worst, err)
        unused_zero = bool((net.unused.main_grad == 0).all())
        gb.zero()
    with open(os.path.join(args.out, f"{rank}.json"), "w") as f:
        json.dump({"max_rel": worst, "launched_in_backward": min(launched), "buckets": len(gb.buckets),
                   "unused_zero": unused_zero}, f)
    gb.close()  # drops its reference to the group: a gloo group outliving destroy aborts at exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
