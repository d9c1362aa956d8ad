"""Aten ops dispatched per DMD2 cycle and per plain training step of the same model, on the CPU: the launch count
that makes a GPU cycle launch-bound (issue 51, item 6), measured where no GPU is needed.

    python benchmarks/count_launches.py --model-size debug                       # digits, B=4, K=5, N=4
    python benchmarks/count_launches.py --model-size wan-digits --data moving-digits
    python benchmarks/count_launches.py --model-size wan-digits --data moving-digits \
        --extra "--distill-method self-forcing --causal --causal-chunk-frames 2"

Two paths, each against a plain training step of the same model on the same path (`--path`, default both):
- eager: the CPU's defaults (eager blocks; the rollout in chunks of B rows, faster on a CPU; --cuda-settings: in one
  forward per step). Counted: every aten op that reaches the dispatcher under a `TorchDispatchMode`, forward and
  backward, less views (`OpOverload.is_view`, and `_unsafe_view`) and bare allocations (`empty*`, `new_empty*`):
  each of the rest is one kernel launch or more on a GPU (a CPU op that a GPU would run as one kernel counts once).
- gpu: a CUDA run's defaults where the CPU's differ: compiled blocks (`--compile`, `models/compiled.py`, inductor's
  C++ kernels standing in for its Triton ones) and the rollout in one forward per step. A dispatch mode cannot see
  inside compiled code, so this path is counted from torch's profiler (`ProfiledCounter`): every inductor kernel and
  every aten op counted as above that no other counted launch encloses. On eager code the two counters agree
  (tests/test_benchmarks.py). The path starts from no compiled graph (`torch._dynamo.reset()`, so what a process
  compiled before cannot change the count) and warms up until a cycle compiles nothing new (the rollout's random
  running counts can each be a new shape), at most --warmup + 8 cycles; a compilation in a counted cycle is printed.
The trainers are benchmarks/bench_dmd2_cycle.py's `Harness` (a random --model-size teacher saved by `FlowTrainer`,
the DMD2 trainer on it, --extra its further flags); a cycle is the trainer's own `StudentTrainer.cycle` (the method's
cycle, the LR schedules, the EMA), each phase counted through the cycle's phase hook; a plain step is
`FlowTrainer.train_step` of the same model and micro-batch. After --warmup of each, --cycles of each are counted and
averaged. Printed per path: `aten ops per cycle: N = R plain steps of M` and the ops per phase; --top K lists the
most frequent ops. Kernels: `DMD2_KERNELS` as set (a CPU runs the torch path of the fused ops).
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import shlex
import sys
import tempfile
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch._inductor.config  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.bench_dmd2_cycle import Harness, add_flags  # noqa: E402
from dmd2_mega.models import compiled  # noqa: E402

PHASE = "phase:"
COMPILING = "(dynamo_timed)"
KERNEL_PREFIXES = ("triton_", "cpp_fused", "graph_")
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


@functools.lru_cache(maxsize=None)
def launches(name: str) -> bool:
    """Whether a profiler event of this name is a launch: an inductor kernel, or an aten op that `OpCounter` counts
    (not a view, not a bare allocation, not a composite that only calls other ops, e.g. `aten::linear`)."""
    if not name.startswith("aten::"):
        return name.startswith(KERNEL_PREFIXES) or "cpp_fused" in name
    packet = getattr(torch.ops.aten, name[len("aten::"):], None)
    if name[len("aten::"):] in NO_LAUNCH:
        return False
    if packet is None:
        return True
    overloads = []
    for o in packet.overloads():
        try:
            op = getattr(packet, o)
            overloads.append((op, op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)))
        except RuntimeError:  # an overload the dispatcher does not hold
            continue
    if overloads and all(op.is_view for op, _ in overloads):
        return False
    functional = [composite for op, composite in overloads if "out" not in op._overloadname]
    return not (functional and all(functional))


class ProfiledCounter:
    """The same count for code that runs compiled regions, which a dispatch mode cannot see (torch.compile falls back
    to eager under one): torch's profiler records every op and, with `enable_kernel_profile`, every inductor kernel;
    a launch is an event `launches` accepts with no launch among its ancestors (an op inside a kernel's call is that
    kernel's) and no compilation (dynamo's `... (dynamo_timed)` ranges: a compilation's traced ops run nothing). `phase(name)` opens a profiler range per phase, so the counts split by phase."""

    def __init__(self):
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.total, self.by_op, self.phases, self._open = 0, collections.Counter(), collections.Counter(), None

    def __enter__(self):
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        self.phase(None)
        self.prof.__exit__(*exc)
        events = self.prof.events()
        ranges = [(e.time_range.start, e.time_range.end, e.name[len(PHASE):]) for e in events
                  if e.name.startswith(PHASE)]
        for e in events:
            if not launches(e.name):
                continue
            p = e.cpu_parent
            while p is not None and not launches(p.name) and not p.name.endswith(COMPILING):
                p = p.cpu_parent
            if p is not None:
                continue
            self.total += 1
            self.by_op[e.name.removeprefix("aten::")] += 1
            t = e.time_range.start
            self.phases[next((name for a, b, name in ranges if a <= t <= b), "")] += 1
        return False

    def phase(self, name) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None
        if name is not None:
            self._open = torch.profiler.record_function(PHASE + name)
            self._open.__enter__()


class PhaseMarks:
    """The trainer's phase hook (`PhaseClock`) wrapped: tells the counter where each phase starts and ends."""

    def __init__(self, clock, mark):
        self.clock, self.mark = clock, mark

    def __call__(self, phase: str) -> None:
        self.mark(phase)
        self.clock(phase)

    def end_cycle(self) -> None:
        self.mark(None)
        self.clock.end_cycle()

    def __getattr__(self, name):
        return getattr(self.clock, name)


class DispatchPhases(OpCounter):
    """`OpCounter` split by phase (the eager path)."""

    def __init__(self):
        super().__init__()
        self.phases, self._at = collections.Counter(), None

    def phase(self, name) -> None:
        if self._at is not None:
            self.phases[self._at[0]] += self.total - self._at[1]
        self._at = (name, self.total) if name is not None else None


def parse_args(argv=None):
    p = add_flags(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    p.add_argument("--extra", default="", help="further pretrain_dmd2.py flags of the student trainer, one string")
    p.add_argument("--cycles", type=int, default=2, help="cycles (and plain steps) counted, after --warmup")
    p.add_argument("--top", type=int, default=0, help="list the K most frequent ops of a cycle")
    p.add_argument("--path", choices=("eager", "gpu", "both"), default="both",
                   help="eager: the CPU's defaults (eager blocks, the rollout in chunks of B); gpu: a CUDA run's "
                        "defaults (compiled blocks, the rollout in one forward per step); both (default)")
    p.add_argument("--cuda-settings", action="store_true",
                   help="the eager path too with the rollout in one forward per step, as on CUDA")
    p.set_defaults(micro_batch_size=4, warmup=1)
    return p.parse_args(argv)


def count(counter, fn, n: int) -> float:
    """Mean launches of n calls of fn() under `counter`."""
    with counter:
        for _ in range(n):
            fn()
    return counter.total / n


def measure(a, gpu: bool) -> dict:
    """Launches per cycle and per plain step on one path (`--path`)."""
    if gpu:
        torch._inductor.config.cpp.enable_kernel_profile = True  # each inductor kernel a profiler event
        torch._dynamo.reset()  # no graph from earlier in the process (module docstring)
    new = ProfiledCounter if gpu else DispatchPhases
    with tempfile.TemporaryDirectory(prefix="count_launches_") as tmp:
        h = Harness(a, tmp, tuple(shlex.split(a.extra)), shared=("--compile",) if gpu else ("--no-compile",))
        tr = h.tr
        if gpu or a.cuda_settings:
            tr.method.settings = replace(tr.method.settings, rollout_chunk=None)
        for _ in range(a.warmup):
            tr.cycle()
            h.plain.train_step()
        settled = settle(tr, 8) if gpu else 0
        before = compiled.graphs()
        plain = count(new(), h.plain.train_step, a.cycles)
        counter, clock = new(), tr.clock
        tr.clock = PhaseMarks(clock, counter.phase)
        try:
            per_cycle = count(counter, tr.cycle, a.cycles)
        finally:
            tr.clock = clock
    late = compiled.graphs() - before
    if late:
        print(f"  ({late} graphs compiled in the counted cycles: a new rollout shape; their traced ops not counted)")
    phases = {name: n / a.cycles for name, n in counter.phases.items() if name}
    return {"cycle": per_cycle, "plain": plain, "phases": phases, "outside": per_cycle - sum(phases.values()),
            "by_op": counter.by_op, "settled": settled, "late": late}


def settle(tr, most: int) -> int:
    """Further warm-up cycles until one compiles no new graph (at most `most`); how many were run."""
    for n in range(1, most + 1):
        before = compiled.graphs()
        tr.cycle()
        if compiled.graphs() == before:
            return n
    return most


def main(argv=None) -> dict:
    a = parse_args(argv)
    torch.set_num_threads(a.threads or 1)
    kernels = os.environ.get("DMD2_KERNELS", "unset") + (" (TRITON_INTERPRET)" if os.environ.get("TRITON_INTERPRET")
                                                         else "")
    print(f"{a.model_size} on {a.data} | B={a.micro_batch_size} K={a.dmd2_critic_steps_per_rollout} "
          f"N={a.dmd2_denoising_steps} g={a.dmd2_teacher_guidance_scale} | {a.extra or 'DMD2'} | torch "
          f"{torch.__version__}, DMD2_KERNELS {kernels} | mean of {a.cycles} after {a.warmup}")
    out = {}
    for path in (("eager", "gpu") if a.path == "both" else (a.path,)):
        r = out[path] = measure(a, path == "gpu")
        what = ("GPU path: compiled blocks, the rollout in one forward per step" if path == "gpu" else
                "eager path: " + ("the rollout in one forward per step" if a.cuda_settings else
                                  "the CPU's defaults, the rollout in chunks of B"))
        what += f" (warm once a further {r['settled']} cycles compiled nothing new)" if r["settled"] else ""
        print(f"{what}\naten ops per cycle: {r['cycle']:,.0f} = {r['cycle'] / r['plain']:.1f} plain steps of "
              f"{r['plain']:,.0f}")
        print("  " + " | ".join(f"{name} {n:,.0f}" for name, n in r["phases"].items())
              + f" | around the phases {r['outside']:,.0f}")
        if a.top:
            print("  most frequent per cycle: " + ", ".join(f"{op} {n / a.cycles:,.0f}"
                                                         for op, n in r["by_op"].most_common(a.top)))
    if len(out) == 2:
        print(f"GPU path / eager path: {out['gpu']['cycle'] / out['eager']['cycle']:.2f}x per cycle")
    return out


if __name__ == "__main__":
    main()
