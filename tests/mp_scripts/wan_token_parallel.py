#!/usr/bin/env python
"""One forward + backward of a small Wan under TP / CP / SP; rank 0 saves the output and full gradients.

    torchrun --standalone --nproc-per-node N tests/mp_scripts/wan_token_parallel.py --out DIR \
        LAYOUT [LAYOUT ...]        (LAYOUT = name:TP:CP:SP:RECOMPUTE, e.g. cp2:1:2:0:0; TP x CP divides N)

Each layout runs in turn in the same processes (megatron-core's groups are rebuilt between them) and rank 0
saves DIR/<name>.pt. TP = CP = 1 on N ranks is DP = N with the same inputs on every rank: the world of one's
maths (the DP mean of equal gradients is exact).

The model (4 heads, so TP x CP up to 4) and the inputs are built from fixed seeds; the latent grid is 3 x 3 x 5
= 45 tokens (odd, and 3 frames: neither a multiple of CP=2). The loss takes the output and the GAN head's
token-grid features (gathered): mean((v - target)^2) + mean(features(layer 0)^2). Gradients go through the run's
`GradBuffer` (summed over DP x CP, divided by DP; sequence-parallel parameters summed over TP), then each is
gathered to its TP=1 tensor. Every rank checks that its output equals rank 0's (the output gather gives all
ranks the same full tensor).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dmd2_mega.train.grad_buffer import GradBuffer  # noqa: E402
from dmd2_mega.models import BuildOptions, DataShape  # noqa: E402
from dmd2_mega.models.wan import Wan, WanSpec  # noqa: E402
from dmd2_mega.distributed.parallel import tp_partition_dim  # noqa: E402
from tests.mp_scripts.layouts import run_layouts  # noqa: E402
from tests.mp_scripts.tp_forward_backward import gather_full  # noqa: E402

SPEC = WanSpec("wan-cp-test", num_heads=4, head_dim=8, num_layers=2, ffn_dim=32, in_channels=4, out_channels=4,
               text_dim=16, freq_dim=16)
SHAPE = DataShape(4, (3, 6, 10), cond_shape=(5, 16))


def inputs():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, *SHAPE.sample_shape, generator=g)
    return (x, torch.tensor([0.3, 0.85]), torch.randn(2, *SHAPE.cond_shape, generator=g),
            torch.randn(x.shape, generator=g))


def run(ps, name: str, cp: int, sp: bool, recompute: bool, out_dir: str) -> None:
    model = Wan(SPEC, SHAPE, ps.tp_size, BuildOptions(recompute=recompute, context_parallel=cp, sequence_parallel=sp))
    with torch.no_grad():  # Wan zero-inits its output projection; a random one lets the gradients flow
        w = model.proj_out.weight
        w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(3)) / w.shape[1] ** 0.5)
    grads = GradBuffer(model, ps.dp_cp_group, average_over=ps.dp_size, tp_group=ps.tp_group)
    x, sigma, cond, target = inputs()
    out = model(x, sigma, cond)
    feats = model.features(x, sigma, cond, 0)
    with torch.no_grad():  # the GAN head's tap: velocity and features of one forward, equal to the two calls
        both = model.forward_features(x, sigma, cond, 0)
    assert torch.equal(both[0], out) and torch.equal(both[1], feats), f"{name}, rank {ps.rank}: forward_features"
    loss = ((out - target) ** 2).mean() + (feats ** 2).mean()
    loss.backward()
    grads.finish()
    ref = out.detach().clone()
    dist.broadcast(ref, 0)
    assert torch.equal(ref, out.detach()), f"{name}, rank {ps.rank}: the gathered output differs from rank 0's"
    full = {n: gather_full(q.main_grad, tp_partition_dim(q), ps) for n, q in model.named_parameters()}
    if ps.rank == 0:
        torch.save({"out": out.detach(), "feats": feats.detach(), "loss": loss.detach(), "grads": full},
                   os.path.join(out_dir, f"{name}.pt"))
    grads.close()


def main() -> int:
    return run_layouts(lambda ps, name, cp, sp, more, _, out: run(ps, name, cp, sp, more == ["1"], out))


if __name__ == "__main__":
    sys.exit(main())
