#!/usr/bin/env python
"""Every torch.distributed collective of a teacher step and a DMD2 cycle gets device tensors.

    torchrun --standalone --nproc-per-node 4 tests/mp_scripts/collectives_on_device.py --out DIR

On a GPU a collective on a host tensor fails under NCCL (`count_parameters` once all-reduced a CPU float64
tensor); on a CPU run everything is on the host, so "on the compute device" is checked by provenance: a
TorchFunctionMode marks every tensor made by a factory call (torch.tensor, zeros, ones, empty, full, arange,
rand*, as_tensor, ...) WITHOUT an explicit `device=`, every `.cpu()` result, and every result computed from
a marked tensor; a device move (`.to(device)`, `.to(device=...)`, `.cuda()`; `Module.to` goes through it)
clears the mark. The
collectives (all_reduce, all_gather, all_gather_into_tensor, broadcast, reduce_scatter_tensor,
all_to_all_single) are wrapped to record each call whose tensors carry the mark.
Run (TP=2 x DP=2 on 4 ranks, debug DiT, digits): the teacher trainer's 2 steps with a save, then the DMD2
trainer's 2 cycles with the GAN head and EMA on that teacher, an eval (DP all-gather of samples) and a
save; then one planted all_reduce of a host-made tensor (the checker's own test). Each rank writes {rank}.json:
{"checked": n collectives, "violations": [...] of the run, "planted": [...] of the planted call}.
"""
import argparse
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from dmd2_mega.arguments import parse_dmd2_args, parse_flow_args  # noqa: E402
from dmd2_mega.methods.dmd2.method import DMD2Trainer  # noqa: E402
from dmd2_mega.distributed.parallel import destroy_distributed  # noqa: E402
from dmd2_mega.teacher_trainer import FlowTrainer  # noqa: E402

FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
             torch.rand, torch.randn, torch.randint, torch.randperm, torch.linspace, torch.eye}
MARK = "_made_on_host"


def marked(x) -> bool:
    if isinstance(x, torch.Tensor):
        return getattr(x, MARK, False)
    if isinstance(x, (list, tuple)):
        return any(marked(v) for v in x)
    if isinstance(x, dict):
        return any(marked(v) for v in x.values())
    return False


def mark(x) -> None:
    if isinstance(x, torch.Tensor):
        setattr(x, MARK, True)
    elif isinstance(x, (list, tuple)):
        for v in x:
            mark(v)


def is_move(func, args, kwargs) -> bool:
    if func is torch.Tensor.cuda or (func is torch.Tensor.to and "device" in kwargs):
        return True
    return func is torch.Tensor.to and any(isinstance(a, (torch.device, str)) for a in args[1:])


class HostProvenance(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in FACTORIES:
            if "device" not in kwargs:
                mark(out)
        elif func is torch.Tensor.cpu:
            mark(out)
        elif is_move(func, args, kwargs):  # on the device now (on a CPU run `.to(cpu)` returns the same object)
            if isinstance(out, torch.Tensor):
                setattr(out, MARK, False)
        elif marked(args) or marked(kwargs):
            if not (isinstance(out, torch.Tensor) and any(out is a for a in args)):  # in-place: same object
                mark(out)
        return out


def wrap_collectives(log: dict) -> None:
    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor",
                 "all_to_all_single"):
        real = getattr(dist, name)

        def wrapper(*args, _real=real, _name=name, **kwargs):
            log["checked"] += 1
            tensors = list(args) + list(kwargs.values())
            if marked(tensors):
                stack = "".join(traceback.format_stack(limit=6)[:-1])
                log["violations"].append({"collective": _name, "where": stack})
            return _real(*args, **kwargs)
        setattr(dist, name, wrapper)
        setattr(torch.distributed, name, wrapper)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    log = {"checked": 0, "violations": []}
    wrap_collectives(log)
    common = ["--model-size", "debug", "--tensor-model-parallel-size", "2", "--log-interval", "1", "--seed", "3"]
    teacher, student = os.path.join(a.out, "teacher"), os.path.join(a.out, "student")
    try:
        with HostProvenance():
            FlowTrainer(parse_flow_args(common + ["--micro-batch-size", "4", "--global-batch-size", "16",
                                                  "--train-iters", "2", "--save", teacher])).train()
            DMD2Trainer(parse_dmd2_args(common + [
                "--teacher-load", teacher, "--micro-batch-size", "2", "--global-batch-size", "8",
                "--dmd2-critic-steps-per-rollout", "2", "--train-iters", "2", "--dmd2-gan", "--ema-decay", "0.5",
                "--dmd2-teacher-guidance-scale", "2", "--eval-interval", "2", "--eval-num-samples", "12",
                "--save", student])).train()
            clean = list(log["violations"])
            dist.all_reduce(torch.tensor([1.0]))  # planted: the check must catch this one
        log["planted"] = log["violations"][len(clean):]
        log["violations"] = clean
        with open(os.path.join(a.out, f"{dist.get_rank()}.json"), "w") as f:
            json.dump(log, f)
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
