#!/usr/bin/env python
"""dmd2_kernels.qk_norm_rope under tensor parallelism: each rank holds a contiguous block of heads.

    torchrun --standalone --nproc-per-node 2 tests/mp_scripts/qk_norm_rope_tp.py --out DIR [--impls torch,triton]

Every rank draws the same full tensors from torch.Generator(0): x [3, 7, 6 * 12] float32 (6 heads of
head_dim 12), weight [72], dy [3, 7, 72], rotary angles [7, 6]. It runs the op at G = 1 on the full
hidden (group=None), then at G = WORLD on its slice of heads (x[..., r HL:(r + 1) HL], HL = 72 / G,
weight and dy sliced alike), with and without rotary, for each impl, and writes {rank}.json:
{impl: {"rope" | "norope": {"y", "dx", "dweight": relative max error of the TP result against the
G = 1 result sliced, "local_only": the same for y of group=None on the slice (the norm over the local
heads alone, which must differ: it shows the all-reduce is what makes the TP result right)}}}.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import dmd2_kernels  # noqa: E402

B, S, HEADS, D = 3, 7, 6, 12


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) / max(float(b.double().abs().max()), 1e-30)


def run(x, w, cos, sin, dy, group, impl):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = dmd2_kernels.qk_norm_rope(x, w, cos, sin, D, group=group, impl=impl)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    return y.detach(), dx, dw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--impls", default="torch")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        g = torch.Generator().manual_seed(0)
        H = HEADS * D
        x = 3.0 * torch.randn(B, S, H, generator=g)
        w = 1.0 + 0.5 * torch.randn(H, generator=g)
        dy = torch.randn(B, S, H, generator=g)
        ang = 6.0 * torch.rand(S, D // 2, generator=g)
        HL = H // world
        cols = slice(rank * HL, (rank + 1) * HL)
        out = {}
        for impl in args.impls.split(","):
            out[impl] = {}
            for name, (cos, sin) in (("rope", (ang.cos(), ang.sin())), ("norope", (None, None))):
                y1, dx1, dw1 = run(x, w, cos, sin, dy, None, impl)
                yt, dxt, dwt = run(x[..., cols], w[cols], cos, sin, dy[..., cols].contiguous(), dist.group.WORLD, impl)
                y_local = run(x[..., cols], w[cols], cos, sin, dy[..., cols].contiguous(), None, impl)[0]
                out[impl][name] = {"y": rel_err(yt, y1[..., cols]), "dx": rel_err(dxt, dx1[..., cols]),
                                   "dweight": rel_err(dwt, dw1[cols]), "local_only": rel_err(y_local, y1[..., cols])}
        with open(os.path.join(args.out, f"{rank}.json"), "w") as f:
            json.dump({"world": world, "results": out}, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
