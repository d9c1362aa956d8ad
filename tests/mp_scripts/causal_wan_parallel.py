#!/usr/bin/env python
"""A causal Wan under TP / CP / SP: the parallel pass's forward + backward and the cached stream; rank 0 saves them.

    torchrun --standalone --nproc-per-node N tests/mp_scripts/causal_wan_parallel.py --out DIR \
        LAYOUT [LAYOUT ...]        (LAYOUT = name:TP:CP:SP, e.g. cp2:1:2:0; TP x CP divides N)

For each layout and each causal layout (chunks of 2 frames; frame-wise chunks with a window of 2 and a sink of 1)
the same processes rebuild megatron-core's groups and rank 0 saves DIR/<name>-<causal>.pt: the parallel pass's
output (a level per chunk), the GAN head's features, the loss mean((v - target)^2) + mean(features^2), every
gradient through the run's `GradBuffer` gathered to its TP=1 tensor, and the chunk-by-chunk cached stream's
output on the same inputs. The grid is 5 x 3 x 4 = 60 tokens: 5 frames (not a multiple of the chunk), and frames
of 12 tokens, so under CP = 2 (30 tokens a rank) and SP a rank's tokens do not start at a frame. A chunk of one
frame under TP = 2 x CP = 2 x SP is 12 tokens split 3 ways per rank.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dmd2_mega.train.grad_buffer import GradBuffer  # noqa: E402
from dmd2_mega.models import BuildOptions, DataShape  # noqa: E402
from dmd2_mega.models.causal import CausalLayout  # noqa: E402
from dmd2_mega.models.wan import WanSpec  # noqa: E402
from dmd2_mega.models.wan.family import WanFamily  # noqa: E402
from dmd2_mega.distributed.parallel import tp_partition_dim  # noqa: E402
from tests.mp_scripts.layouts import run_layouts  # noqa: E402
from tests.mp_scripts.tp_forward_backward import gather_full  # noqa: E402

SPEC = WanSpec("causal-cp-test", num_heads=4, head_dim=8, num_layers=2, ffn_dim=32, in_channels=4, out_channels=4,
               text_dim=16, freq_dim=16)
SHAPE = DataShape(4, (5, 6, 8), cond_shape=(5, 16))
CAUSAL = {"chunk2": CausalLayout(2), "window": CausalLayout(1, window=2, sink=1)}


def inputs(chunks: int):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, *SHAPE.sample_shape, generator=g)
    return (x, torch.rand(2, chunks, generator=g), torch.randn(2, *SHAPE.cond_shape, generator=g),
            torch.randn(x.shape, generator=g))


def run(ps, name: str, cp: int, sp: bool, causal: str, out_dir: str) -> None:
    layout = CAUSAL[causal]
    model = WanFamily().build(SPEC, SHAPE, ps.tp_size, BuildOptions(context_parallel=cp, sequence_parallel=sp,
                                                                    causal=layout))
    with torch.no_grad():  # Wan zero-inits its output projection; a random one lets the gradients flow
        w = model.proj_out.weight
        w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(3)) / w.shape[1] ** 0.5)
    grads = GradBuffer(model, ps.dp_cp_group, average_over=ps.dp_size, tp_group=ps.tp_group)
    spans = layout.chunks(SHAPE.spatial[0])
    x, sigma, cond, target = inputs(len(spans))
    out = model(x, sigma, cond)
    feats = model.features(x, sigma, cond, 0)
    loss = ((out - target) ** 2).mean() + (feats ** 2).mean()
    loss.backward()
    grads.finish()
    with torch.no_grad():
        cache = model.new_cache()
        stream = torch.cat([model.stream_forward(x[:, :, a:b], sigma[:, i], cond, cache, write=True)
                            for i, (a, b) in enumerate(spans)], 2)
    for t, what in ((out.detach(), "output"), (stream, "stream")):
        ref = t.clone()
        dist.broadcast(ref, 0)
        assert torch.equal(ref, t), f"{name}, rank {ps.rank}: the gathered {what} differs from rank 0's"
    full = {n: gather_full(q.main_grad, tp_partition_dim(q), ps) for n, q in model.named_parameters()}
    if ps.rank == 0:
        torch.save({"out": out.detach(), "stream": stream, "feats": feats.detach(), "loss": loss.detach(),
                    "grads": full}, os.path.join(out_dir, f"{name}-{causal}.pt"))
    grads.close()


def main() -> int:
    return run_layouts(lambda ps, name, cp, sp, _, causal, out: run(ps, name, cp, sp, causal, out), variants=CAUSAL)


if __name__ == "__main__":
    sys.exit(main())
