"""Host syncs of DMD2 and Self-Forcing training, counted: the calls from the project's own code (dmd2_mega/,
kernels/) of `Tensor.item`, `Tensor.tolist`, `Tensor.cpu`, `Tensor.to("cpu")`, `Tensor.__bool__` and boolean-mask
indexing, each of which waits for the device on CUDA. Counted on CPU by patched methods (debug DiT, K = 2 critic steps, M = 2
micro-batches, GAN head and EMA on), after one warm-up cycle.

Budget (GPU issue 12; before it, a cycle made K + 1 `.item()` in optim.Optimizer._finite, one per optimizer
step, and M `.tolist()` in rollout._running_counts, one per rollout: K + 1 + M = 5 here; issue 51 item 4 then
took the loop's per-iteration read away):
  inside `DMD2Trainer.cycle` and a Self-Forcing cycle: none. The non-finite skip is decided on the device (fused
      AdamW's found-inf), the rollout's stop steps (Self-Forcing's exits and windows) are drawn on the host for the
      whole cycle at its start and reach the device in one non-blocking copy;
  per iteration of the training loop: none. The skip counters stay on the device between check points and the
      exit flags are host values (`ExitController.poll`, one rank);
  per check point of the loop (a multiple of --log-interval or --save-interval, or the last iteration): ONE,
      `ExitController.check` reading the kept skip counters (and, with several ranks, the exit flags' all-reduce);
  per log interval: the metrics' `.cpu().tolist()` in `DMD2Trainer.log`.
The loop runs more cycles than it has check points (--log-interval past the last cycle: one check point, the
last), so a read per iteration coming back fails the count. A new sync anywhere fails CI.

CUDA-graph precondition (`test_cycle_shapes_are_fixed_after_warm_up`): the (op, argument shapes) an aten dispatch
sees in a DMD2 cycle after warm-up. Outside the rollout every cycle dispatches the same sequence. The rollout's
forward sizes are its running counts (rows still running at a step), drawn per cycle by design and kept exact
(a padded forward need not give bit-equal rows: `methods/rollout.py`), so each of its (op, shapes) must be one the
warm-up dispatched: a cycle, and the n rollouts of `bucket_stop_steps` that run every count once.
"""
import collections
import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dmd2_mega.arguments import parse_dmd2_args
from dmd2_mega.methods.dmd2.method import DMD2Trainer
from tests.utils import world_of_one

pytestmark = pytest.mark.timeout(120)
ROOTS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d) + os.sep
              for d in ("dmd2_mega", os.path.join("kernels", "dmd2_kernels")))
K, M = 2, 2


def count_syncs(monkeypatch) -> collections.Counter:
    counts = collections.Counter()

    def counted(name, real, is_sync=lambda *a, **kw: True):
        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(ROOTS) and is_sync(self, *args, **kwargs):
                counts[(name, os.path.basename(caller.f_code.co_filename), caller.f_code.co_name)] += 1
            return real(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, wrapper)

    def bool_index(self, idx, *rest):
        items = idx if isinstance(idx, tuple) else (idx,)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)

    def to_host(self, *args, **kwargs):  # a device-to-host copy asked for by name: `.to("cpu")` (on a CPU run the
        # compute device is the host too, so a `.to(device)` cannot be told from one here: `.cpu()` and "cpu" can)
        return any(a == "cpu" for a in (*args, kwargs.get("device")) if isinstance(a, str))

    for name in ("item", "tolist", "cpu", "__bool__"):
        counted(name, getattr(torch.Tensor, name))
    counted("__getitem__", torch.Tensor.__getitem__, bool_index)
    counted("to", torch.Tensor.to, to_host)
    return counts


def dmd2_trainer(teacher: str, iters: int, *extra) -> DMD2Trainer:
    return DMD2Trainer(parse_dmd2_args([
        "--model-size", "debug", "--teacher-load", teacher, "--micro-batch-size", "2",
        "--global-batch-size", str(2 * M), "--dmd2-critic-steps-per-rollout", str(K),
        "--train-iters", str(iters), "--dmd2-gan", "--ema-decay", "0.5",
        "--dmd2-teacher-guidance-scale", "2", "--no-offload-inactive", *extra]))


def test_cycle_host_syncs_within_budget(debug_teacher, monkeypatch):
    loop_cycles = 3
    with world_of_one():  # an exit flag and --max-nan-iterations on: the loop's checks run every cycle
        tr = dmd2_trainer(debug_teacher, 2 + loop_cycles, "--log-interval", "100", "--max-nan-iterations", "3",
                          "--exit-duration-in-mins", "1000")
        tr.cycle()  # warm-up
        counts = count_syncs(monkeypatch)
        tr.cycle()
        in_cycle = dict(counts)
        counts.clear()
        tr.train()  # cycles 3 to 5; one check point and one log, at the last cycle
        monkeypatch.undo()
    assert in_cycle == {}, f"host syncs inside one cycle: {in_cycle} (budget: none)"
    loop = {("tolist", "resilience.py", "check"): 1,
            ("cpu", "trainer.py", "log"): 1, ("tolist", "trainer.py", "log"): 1}
    assert dict(counts) == loop, (f"host syncs of {loop_cycles} cycles of the loop changed: {dict(counts)} "
                                  f"(budget {loop}: none per cycle, one check point and one log)")


def test_self_forcing_cycle_has_no_host_sync(tmp_path, monkeypatch):
    """The same budget for a Self-Forcing cycle (the causal rollout, the windows, the replaying actor): none. Its
    rollout reads the sigmas as host floats the method keeps from its start and copies the host-drawn exit steps to
    the device once, without blocking."""
    from benchmarks import bench_self_forcing_cycle
    with world_of_one():
        a = bench_self_forcing_cycle.parse_args(["--data", "moving-digits", "--micro-batch-size", "1",
                                                 "--dmd2-critic-steps-per-rollout", "2"])
        tr = bench_self_forcing_cycle.Harness(a, str(tmp_path)).tr
        tr.cycle()  # warm-up
        counts = count_syncs(monkeypatch)
        tr.cycle()
        in_cycle = dict(counts)
        monkeypatch.undo()
    assert in_cycle == {}, f"host syncs inside one Self-Forcing cycle: {in_cycle} (budget: none)"


class ShapeLog(TorchDispatchMode):
    """Every aten op dispatched while on: (phase, op, shapes of its tensor arguments), phase set by `enter`."""

    def __init__(self):
        super().__init__()
        self.ops, self.phase = [], "trainer"

    def enter(self, phase: str) -> None:
        self.phase = phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        shapes = tuple(tuple(a.shape) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor))
        self.ops.append((self.phase, str(func), shapes))
        return func(*args, **kwargs)


class PhaseHook:
    """The trainer's phase clock, also telling a `ShapeLog` which phase runs."""

    def __init__(self, clock, log: ShapeLog):
        self.clock, self.log = clock, log

    def __call__(self, phase: str) -> None:
        self.log.enter(phase)
        self.clock(phase)

    def __getattr__(self, name):
        return getattr(self.clock, name)


def recorded_cycle(tr: DMD2Trainer, monkeypatch) -> list:
    """One `tr.cycle()` (LR schedules, the method's cycle, the EMA) under a ShapeLog: its (phase, op, shapes)."""
    with ShapeLog() as log:
        monkeypatch.setattr(tr, "clock", PhaseHook(tr.clock, log))
        tr.cycle()
    monkeypatch.setattr(tr, "clock", tr.clock.clock)
    return log.ops


def test_cycle_shapes_are_fixed_after_warm_up(debug_teacher, monkeypatch):
    """A CUDA-graph precondition (module docstring): after warm-up no cycle dispatches an (op, shapes) not seen before;
    outside the rollout, cycles 2 and 3 dispatch the same sequence."""
    from dmd2_mega.methods.rollout import bucket_stop_steps, rollout, stop_steps_on
    with world_of_one():
        tr = dmd2_trainer(debug_teacher, 3, "--log-interval", "1")
        st = tr.method.settings
        n, steps = K * st.micro_batch_size, st.student_sigmas.numel()
        warm = recorded_cycle(tr, monkeypatch)  # cycle 1
        cond = tr.micro_batches()[0].cond
        with ShapeLog() as log:  # a rollout at every running count
            log.enter("rollout")
            for stops in stop_steps_on(bucket_stop_steps(n, steps), steps, st.device):
                rollout(tr.roles["student"].model, torch.Generator().manual_seed(0), n, cond, st.student_sigmas,
                        shape=st.shape, device=st.device, max_batch=st.rollout_chunk, stops=stops)
        warm += log.ops
        second, third = recorded_cycle(tr, monkeypatch), recorded_cycle(tr, monkeypatch)
    assert {p for p, _, _ in third} == {"trainer", "rollout", "critic", "actor"}, "the phase hook saw other phases"
    fixed = [[op for op in ops if op[0] != "rollout"] for ops in (second, third)]
    assert fixed[0] == fixed[1], f"outside the rollout, cycles 2 and 3 differ: {first_difference(*fixed)}"
    new = sorted({op for op in third if op[0] == "rollout"} - set(warm) - set(second))
    assert not new, f"the rollout of cycle 3 dispatched (op, shapes) no warm-up did: {new[:5]}"


def first_difference(a: list, b: list) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"op {i}: {a[i] if i < len(a) else 'none'} vs {b[i] if i < len(b) else 'none'}"
