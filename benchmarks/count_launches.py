"""Aten ops dispatched per DMD2 cycle and per plain training step of the same model, on the CPU: the launch count
that makes a GPU cycle launch-bound (issue 51, item 6), measured where no GPU is needed.

    python benchmarks/count_launches.py --model-size debug                       # digits, B=4, K=5, N=4
    python benchmarks/count_launches.py --model-size wan-digits --data moving-digits
    python benchmarks/count_launches.py --model-size wan-digits --data moving-digits \
        --extra "--distill-method self-forcing --causal --causal-chunk-frames 2"

What is counted: every aten op that reaches the dispatcher under a `TorchDispatchMode`, forward and backward,
less views (`OpOverload.is_view`, and `_unsafe_view`) and bare allocations (`empty*`, `new_empty*`): each of the
rest is one kernel launch or more on a GPU (a CPU op that a GPU would run as one kernel counts once).
--cuda-settings counts the cycle with the settings a CUDA run gets where the CPU's differ: the rollout's forwards
in one batch per step (`DMD2Settings.rollout_chunk` None; the CPU runs chunks of B rows, faster there). The trainers are
benchmarks/bench_dmd2_cycle.py's `Harness` (a random --model-size teacher saved by `FlowTrainer`, the DMD2 trainer
on it, --extra its further flags); a cycle is the trainer's own `StudentTrainer.cycle` (the method's cycle, the LR
schedules, the EMA), each phase counted through the cycle's phase hook; a plain step is `FlowTrainer.train_step`
of the same model and micro-batch. After --warmup of each, --cycles of each are counted and averaged.
Printed: `aten ops per cycle: N = R plain steps of M` and the ops per phase; --top K lists the most frequent ops.
The path counted is the one this machine runs (eager torch kernels on a CPU; `DMD2_KERNELS` as set).
"""
from __future__ import annotations

import argparse
import collections
import os
import shlex
import sys
import tempfile
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.bench_dmd2_cycle import Harness, add_flags  # noqa: E402

ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
NO_LAUNCH = ALLOCATIONS | {"_unsafe_view"}  # a reshape of a contiguous result: metadata only, like a view


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active, views and bare allocations left out."""

    def __init__(self):
        super().__init__()
        self.total, self.by_op = 0, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in NO_LAUNCH:
            self.total += 1
            self.by_op[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class PhaseCounts:
    """The trainer's phase hook (`PhaseClock`) wrapped: the counter's total as each phase starts and at the end."""

    def __init__(self, clock, counter: OpCounter):
        self.clock, self.counter, self.marks = clock, counter, []

    def __call__(self, phase: str) -> None:
        self.marks.append((phase, self.counter.total))
        self.clock(phase)

    def end_cycle(self) -> None:
        self.marks.append(("end", self.counter.total))
        self.clock.end_cycle()

    def __getattr__(self, name):
        return getattr(self.clock, name)


def parse_args(argv=None):
    p = add_flags(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    p.add_argument("--extra", default="", help="further pretrain_dmd2.py flags of the student trainer, one string")
    p.add_argument("--cycles", type=int, default=2, help="cycles (and plain steps) counted, after --warmup")
    p.add_argument("--top", type=int, default=0, help="list the K most frequent ops of a cycle")
    p.add_argument("--cuda-settings", action="store_true", help="the rollout in one forward per step, as on CUDA")
    p.set_defaults(micro_batch_size=4, warmup=1)
    return p.parse_args(argv)


def count(fn, n: int) -> tuple[float, collections.Counter]:
    """Mean ops of n calls of fn() (and the op histogram of all n)."""
    counter = OpCounter()
    with counter:
        for _ in range(n):
            fn()
    return counter.total / n, counter.by_op


def main(argv=None) -> dict:
    a = parse_args(argv)
    torch.set_num_threads(a.threads or 1)
    with tempfile.TemporaryDirectory(prefix="count_launches_") as tmp:
        h = Harness(a, tmp, tuple(shlex.split(a.extra)))
        tr = h.tr
        if a.cuda_settings:
            tr.method.settings = replace(tr.method.settings, rollout_chunk=None)
        for _ in range(a.warmup):
            tr.cycle()
            h.plain.train_step()
        plain, _ = count(h.plain.train_step, a.cycles)
        counter, clock = OpCounter(), tr.clock
        tr.clock = PhaseCounts(clock, counter)
        with counter:
            for _ in range(a.cycles):
                tr.cycle()
        marks, tr.clock = tr.clock.marks, clock
    per_cycle = counter.total / a.cycles
    phases = collections.Counter()
    for (name, start), (_, end) in zip(marks[:-1], marks[1:]):
        if name != "end":
            phases[name] += (end - start) / a.cycles
    outside = per_cycle - sum(phases.values())  # the trainer's cycle around the method's (LR, EMA, counters)
    path = os.environ.get("DMD2_KERNELS", "unset") + (" (TRITON_INTERPRET)" if os.environ.get("TRITON_INTERPRET")
                                                      else "")
    print(f"{a.model_size} on {a.data} | B={a.micro_batch_size} K={a.dmd2_critic_steps_per_rollout} "
          f"N={a.dmd2_denoising_steps} g={a.dmd2_teacher_guidance_scale} | {a.extra or 'DMD2'} | rollout "
          f"{'one forward per step (CUDA)' if a.cuda_settings else 'in chunks of B (CPU)'} | torch "
          f"{torch.__version__}, eager, DMD2_KERNELS {path} | mean of {a.cycles} after {a.warmup}")
    print(f"aten ops per cycle: {per_cycle:,.0f} = {per_cycle / plain:.1f} plain steps of {plain:,.0f}")
    print("  " + " | ".join(f"{name} {n:,.0f}" for name, n in phases.items()) + f" | around the phases {outside:,.0f}")
    if a.top:
        print("most frequent ops per cycle: " + ", ".join(f"{op} {n / a.cycles:,.0f}"
                                                           for op, n in counter.by_op.most_common(a.top)))
    return {"cycle": per_cycle, "plain": plain, "phases": dict(phases), "outside": outside}


if __name__ == "__main__":
    main()
