#!/usr/bin/env python
"""One forward + backward of the debug DiT at the current TP degree; rank 0 saves full tensors.

    python tests/mp_scripts/tp_forward_backward.py --tp 1 --out ref.pt
    torchrun --standalone --nproc-per-node 2 tests/mp_scripts/tp_forward_backward.py --tp 2 --out tp2.pt

Steps (identical on every TP degree):
  1. init_distributed(seed 1234); build_model(debug, 1x8x8 images, 10 classes) -> `init`: every
     parameter all-gathered along its TP partition dim to the full TP=1 tensor.
  2. Perturb every parameter by 0.05 * N(0, 1) drawn at the FULL shape from a generator keyed by
     the parameter's name, then sliced to this rank's shard (so adaLN-Zero's zero matrices become
     non-zero and every branch of the block contributes to output and gradients).
  3. Fixed batch from torch.Generator(0): x [6, 1, 8, 8], sigma [6] in (0, 1), labels [6] in
     [0, 10] (index 0 is the null class 10), target [6, 1, 8, 8];
     loss = mean((model(x, sigma, labels) - target)^2); backward.
  4. Save {init, weights, grads} (full tensors), output [6, 1, 8, 8], loss, count_parameters,
     partition_dims, and the largest difference of each replicated parameter / gradient across
     TP ranks (they must agree).
"""
import argparse
import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dmd2_mega.config import ModelConfig, ParallelConfig  # noqa: E402
from dmd2_mega.models import DataShape, build_model, count_parameters  # noqa: E402
from dmd2_mega.distributed.parallel import destroy_distributed, init_distributed, tp_partition_dim  # noqa: E402


def gather_full(t: torch.Tensor, dim, ps) -> torch.Tensor:
    """The full tensor of a shard (dim = partition dim) or the tensor itself (replicated)."""
    if dim is None or ps.tp_size == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(ps.tp_size)]
    dist.all_gather(parts, t.detach().contiguous(), group=ps.tp_group)
    return torch.cat(parts, dim=dim)


def replica_spread(t: torch.Tensor, ps) -> float:
    """max |t_rank - t_rank0| over the TP group for a replicated tensor."""
    if ps.tp_size == 1:
        return 0.0
    parts = [torch.empty_like(t) for _ in range(ps.tp_size)]
    dist.all_gather(parts, t.detach().contiguous(), group=ps.tp_group)
    return max(float((p - parts[0]).abs().max()) for p in parts)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--recompute", action="store_true")
    a = p.parse_args()
    ps = init_distributed(ParallelConfig(tensor_model_parallel_size=a.tp), seed=1234)
    try:
        cfg = ModelConfig(size="debug", recompute_granularity="full" if a.recompute else None)
        model = build_model(cfg.size, DataShape(1, 8, num_classes=10), tp_size=ps.tp_size, options=cfg.options())
        dims = {n: tp_partition_dim(q) for n, q in model.named_parameters()}
        init = {n: gather_full(q, dims[n], ps) for n, q in model.named_parameters()}

        with torch.no_grad():
            for n, q in model.named_parameters():
                d = dims[n]
                full_shape = list(q.shape)
                if d is not None:
                    full_shape[d] *= ps.tp_size
                g = torch.Generator().manual_seed(zlib.crc32(n.encode()))
                delta = 0.05 * torch.randn(full_shape, generator=g)
                if d is not None:
                    delta = delta.chunk(ps.tp_size, dim=d)[ps.tp_rank]
                q.add_(delta)

        g = torch.Generator().manual_seed(0)
        x = torch.randn(6, 1, 8, 8, generator=g)
        sigma = torch.rand(6, generator=g) * 0.98 + 0.01
        labels = torch.randint(0, 11, (6,), generator=g)
        labels[0] = 10
        target = torch.randn(6, 1, 8, 8, generator=g)
        model.train()
        out = model(x, sigma, labels)
        loss = ((out - target) ** 2).mean()
        loss.backward()

        weights = {n: gather_full(q, dims[n], ps) for n, q in model.named_parameters()}
        grads = {n: gather_full(q.grad, dims[n], ps) for n, q in model.named_parameters()}
        spread = {}
        for n, q in model.named_parameters():
            if dims[n] is None:
                spread[n] = max(replica_spread(q, ps), replica_spread(q.grad, ps))
        spread["output"] = replica_spread(out, ps)
        count = count_parameters(model, ps.tp_group, ps.device)
        if ps.rank == 0:
            torch.save({"tp": ps.tp_size, "init": init, "weights": weights, "grads": grads,
                        "output": out.detach(), "loss": loss.detach(), "count": count,
                        "partition_dims": dims, "replica_spread": spread}, a.out)
            print(f"> saved TP={ps.tp_size} forward/backward to {a.out}", flush=True)
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
