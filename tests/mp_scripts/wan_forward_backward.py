#!/usr/bin/env python
"""One forward + backward of a converted Wan checkpoint at the current TP degree; rank 0 saves full tensors.

    torchrun --standalone --nproc-per-node 2 tests/mp_scripts/wan_forward_backward.py \
        --ckpt CKPT --inputs inputs.pt --out out.pt [--bf16]

CKPT is one of our checkpoints converted from a diffusers folder (`pretrained.import_diffusers`, any TP);
`--model-size CKPT` builds it from its config.json, `load_payload` reshards it to this run's TP. inputs.pt holds
x [B, C, T, H, W], sigma [B], cond [B, L, D] (or an I2V Wan's flat cond [B, N] with its cond_parts) and target (same shape as x); the loss is
mean((model(x, sigma, cond) - target)^2). Saved: output, loss, and every parameter's gradient all-gathered to
its full TP=1 tensor (keyed by our parameter names).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from dmd2_mega.train.checkpoint import load_model_weights, load_payload  # noqa: E402
from dmd2_mega.config import ParallelConfig  # noqa: E402
from dmd2_mega.models import DataShape, build_model  # noqa: E402
from dmd2_mega.distributed.parallel import destroy_distributed, init_distributed, tp_partition_dim  # noqa: E402
from tests.mp_scripts.tp_forward_backward import gather_full  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--inputs", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--bf16", action="store_true")
    a = p.parse_args()
    ps = init_distributed(ParallelConfig(tensor_model_parallel_size=int(os.environ.get("WORLD_SIZE", "1"))))
    try:
        inp = torch.load(a.inputs)
        x, sigma, cond, target = inp["x"], inp["sigma"], inp["cond"], inp["target"]
        parts = inp.get("cond_parts")  # an image-to-video Wan's flat condition (`models/wan/image.py`)
        shape = DataShape(x.shape[1], tuple(x.shape[2:]), cond_shape=None if parts else tuple(cond.shape[1:]),
                          cond_parts=parts)
        model = build_model(a.ckpt, shape, tp_size=ps.tp_size)
        load_model_weights(model, load_payload(a.ckpt, ps, flag="--ckpt")["model"], a.ckpt)
        if a.bf16:
            model = model.to(torch.bfloat16)
        out = model(x, sigma, cond)
        loss = ((out.float() - target) ** 2).mean()
        loss.backward()
        grads = {n: gather_full(q.grad.float(), tp_partition_dim(q), ps) for n, q in model.named_parameters()}
        if ps.rank == 0:
            torch.save({"out": out.detach().float(), "loss": loss.detach(), "grads": grads}, a.out)
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
