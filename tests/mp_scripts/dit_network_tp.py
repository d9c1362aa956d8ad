#!/usr/bin/env python
"""The network forward + backward of converted DiT-family checkpoints at the current TP degree; rank 0 saves
full tensors.

    torchrun --standalone --nproc-per-node 2 tests/mp_scripts/dit_network_tp.py \
        --case CKPT INPUTS OUT [--case CKPT2 INPUTS2 OUT2 ...]

CKPT is one of our checkpoints converted from an official SiT / DiT .pt or a diffusers DiT folder (any TP);
`--model-size CKPT` builds it from its config.json and `load_payload` reshards it to this run's TP. INPUTS holds
x [B, C, H, W], timestep [B], labels [B] and target; the loss is mean((network(x, timestep, labels) - target)^2)
(the network's own prediction, before the parameterisation adapter). Saved: out, and every parameter's gradient
all-gathered to its full TP=1 tensor.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from dmd2_mega.train.checkpoint import load_model_weights, load_payload  # noqa: E402
from dmd2_mega.config import ParallelConfig  # noqa: E402
from dmd2_mega.models import build_model, get_spec  # noqa: E402
from dmd2_mega.distributed.parallel import destroy_distributed, init_distributed, tp_partition_dim  # noqa: E402
from tests.mp_scripts.tp_forward_backward import gather_full  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--case", nargs=3, action="append", required=True, metavar=("CKPT", "INPUTS", "OUT"))
    a = p.parse_args()
    ps = init_distributed(ParallelConfig(tensor_model_parallel_size=int(os.environ.get("WORLD_SIZE", "1"))))
    try:
        for ckpt, inputs, out_path in a.case:
            inp = torch.load(inputs)
            model = build_model(ckpt, get_spec(ckpt).data_shape(), tp_size=ps.tp_size)
            load_model_weights(model, load_payload(ckpt, ps, flag="--ckpt")["model"], ckpt)
            out = model.network(inp["x"], inp["timestep"], inp["labels"])
            ((out - inp["target"]) ** 2).mean().backward()
            grads = {n: gather_full(q.grad, tp_partition_dim(q), ps) for n, q in model.named_parameters()}
            if ps.rank == 0:
                torch.save({"out": out.detach(), "grads": grads}, out_path)
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
