"""Host syncs of one DMD2 cycle, counted: the calls from the project's own code (dmd2_mega/, kernels/) of
`Tensor.item`, `Tensor.tolist`, `Tensor.cpu`, `Tensor.__bool__` and boolean-mask indexing, each of which
waits for the device on CUDA. Counted on CPU by patched methods during `DMD2Trainer.cycle` (debug DiT,
K = 2 critic steps, M = 2 micro-batches, GAN head and EMA on), after one warm-up cycle.

The budget is today's count, per call site, so that a NEW sync anywhere in the cycle fails CI:
  optim.Optimizer._finite  `.item()` once per optimizer step (the non-finite skip): K + 1 per cycle;
  rollout._running_counts  `.tolist()` once per rollout (its prefix lengths): M per cycle.
The target of the GPU issue is at most one per cycle; this budget comes down as those two go.
"""
import collections
import os
import sys

import pytest
import torch

from dmd2_mega.arguments import parse_dmd2_args
from dmd2_mega.dmd2.student_trainer import DMD2Trainer
from tests.utils import world_of_one

pytestmark = pytest.mark.timeout(120)
ROOTS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d) + os.sep
              for d in ("dmd2_mega", "kernels"))
K, M = 2, 2


def count_syncs(monkeypatch) -> collections.Counter:
    counts = collections.Counter()

    def counted(name, real, is_sync=lambda *a: True):
        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(ROOTS) and is_sync(self, *args):
                counts[(name, os.path.basename(caller.f_code.co_filename), caller.f_code.co_name)] += 1
            return real(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, wrapper)

    def bool_index(self, idx, *rest):
        items = idx if isinstance(idx, tuple) else (idx,)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)

    for name in ("item", "tolist", "cpu", "__bool__"):
        counted(name, getattr(torch.Tensor, name))
    counted("__getitem__", torch.Tensor.__getitem__, bool_index)
    return counts


def test_cycle_host_syncs_within_budget(debug_teacher, monkeypatch):
    with world_of_one():
        tr = DMD2Trainer(parse_dmd2_args([
            "--model-size", "debug", "--teacher-load", debug_teacher, "--micro-batch-size", "2",
            "--global-batch-size", str(2 * M), "--dmd2-critic-steps-per-rollout", str(K), "--train-iters", "4",
            "--dmd2-gan", "--ema-decay", "0.5", "--dmd2-teacher-guidance-scale", "2", "--no-offload-inactive"]))
        tr.cycle()  # warm-up
        counts = count_syncs(monkeypatch)
        tr.cycle()
        monkeypatch.undo()
    budget = {("item", "optim.py", "_finite"): K + 1, ("tolist", "rollout.py", "_running_counts"): M}
    assert dict(counts) == budget, f"host syncs per cycle changed: {dict(counts)} (budget {budget})"
