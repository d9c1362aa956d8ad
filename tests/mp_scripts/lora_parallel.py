#!/usr/bin/env python
"""One forward + backward of LoRA-adapted models under TP / CP / SP; rank 0 saves the output and the adapters'
full gradients.

    torchrun --standalone --nproc-per-node N tests/mp_scripts/lora_parallel.py --out DIR \
        LAYOUT [LAYOUT ...]        (LAYOUT = name:TP:CP:SP, e.g. tp2sp:2:1:1; TP x CP divides N)

Per layout two models: the small Wan of wan_token_parallel.py (every target: self- and cross-attention q, k, v, out,
FFN; inputs and loss as there) and the `debug` DiT (qkv, proj, fc1, fc2; TP only: at CP > 1 or SP it is skipped).
Each has its base perturbed from a seeded whole tensor (`perturb`) and frozen, and rank-2 adapters (alpha 4) whose B
is set from a seeded whole matrix, sliced as the adapter's layout (B = 0 would give A no gradient). Gradients go
through the run's `GradBuffer` (the adapters' partial TP factors summed over TP), then each is gathered to its
TP = 1 tensor. Saved: DIR/<name>-wan.pt, DIR/<name>-dit.pt
with out, loss and grads {parameter name: full gradient} of the trainable (adapter) parameters only.
"""
import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from dmd2_mega.distributed.parallel import tp_partition_dim  # noqa: E402
from dmd2_mega.models import BuildOptions, DataShape, build_model  # noqa: E402
from dmd2_mega.models.lora import LoRA, attach_lora  # noqa: E402
from dmd2_mega.models.wan import Wan  # noqa: E402
from dmd2_mega.models.wan.family import WanFamily  # noqa: E402
from dmd2_mega.models.dit.family import DiTFamily  # noqa: E402
from dmd2_mega.train.grad_buffer import GradBuffer  # noqa: E402
from tests.mp_scripts.layouts import run_layouts  # noqa: E402
from tests.mp_scripts.tp_forward_backward import gather_full  # noqa: E402
from tests.mp_scripts.wan_token_parallel import SHAPE, SPEC, inputs  # noqa: E402

DIT_SHAPE = DataShape(4, 8, num_classes=10)  # the `debug` DiT on 4 x 8 x 8 latents, 10 classes


def perturb(model, ps) -> None:
    """Add 0.05 x a seeded whole random tensor (sliced like the parameter) to every base parameter: the zero-inits
    (Wan's output projection, DiT's adaLN) would otherwise keep the gradient from the blocks."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            dim = tp_partition_dim(p)
            shape = list(p.shape)
            if dim is not None:
                shape[dim] *= ps.tp_size
            full = torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
            p.add_(0.05 * (full if dim is None else full.chunk(ps.tp_size, dim)[ps.tp_rank]))


def adapt(model, targets, ps) -> None:
    """Rank-2 adapters on `targets`, base frozen, B from a seeded whole matrix sliced like the adapter's B."""
    for p in model.parameters():
        p.requires_grad_(False)
    attach_lora(model, targets, rank=2, alpha=4.0, seed=5)
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, LoRA):
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                full = torch.randn(m.B.shape[0] * (ps.tp_size if m.kind == "column" else 1), m.rank, generator=g)
                m.B.copy_(full.chunk(ps.tp_size, 0)[ps.tp_rank] if m.kind == "column" else full)


def step(model, ps, loss_fn, out_path: str) -> None:
    grads = GradBuffer(model, ps.dp_cp_group, average_over=ps.dp_size, tp_group=ps.tp_group)
    out, loss = loss_fn(model)
    loss.backward()
    grads.finish()
    full = {n: gather_full(q.main_grad, tp_partition_dim(q), ps) for n, q in model.named_parameters()
            if q.requires_grad}
    if ps.rank == 0:
        torch.save({"out": out.detach(), "loss": loss.detach(), "grads": full}, out_path)
    grads.close()


def run(ps, name: str, cp: int, sp: bool, out_dir: str) -> None:
    wan = Wan(SPEC, SHAPE, ps.tp_size, BuildOptions(context_parallel=cp, sequence_parallel=sp))
    perturb(wan, ps)
    adapt(wan, WanFamily.lora_targets, ps)
    x, sigma, cond, target = inputs()

    def wan_loss(model):
        out = model(x, sigma, cond)
        return out, ((out - target) ** 2).mean()
    step(wan, ps, wan_loss, os.path.join(out_dir, f"{name}-wan.pt"))
    if cp > 1 or sp:
        return
    shape = DIT_SHAPE
    dit = build_model("debug", shape, tp_size=ps.tp_size)
    perturb(dit, ps)
    adapt(dit, DiTFamily.lora_targets, ps)
    g = torch.Generator().manual_seed(9)
    xd = torch.randn(2, *shape.sample_shape, generator=g)
    labels = torch.tensor([1, 3])
    want = torch.randn(xd.shape, generator=g)

    def dit_loss(model):
        out = model(xd, torch.tensor([0.2, 0.7]), labels)
        return out, ((out - want) ** 2).mean()
    step(dit, ps, dit_loss, os.path.join(out_dir, f"{name}-dit.pt"))


def main() -> int:
    return run_layouts(lambda ps, name, cp, sp, _, __, out: run(ps, name, cp, sp, out))


if __name__ == "__main__":
    sys.exit(main())
