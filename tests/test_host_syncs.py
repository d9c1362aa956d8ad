"""Host syncs of DMD2 and Self-Forcing training, counted: the calls from the project's own code (dmd2_mega/,
kernels/) of `Tensor.item`, `Tensor.tolist`, `Tensor.cpu`, `Tensor.to("cpu")`, `Tensor.__bool__` and boolean-mask
indexing, each of which waits for the device on CUDA. Counted on CPU by patched methods (debug DiT, K = 2 critic steps, M = 2
micro-batches, GAN head and EMA on), after one warm-up cycle.

Budget (GPU issue 12; before it, a cycle made K + 1 `.item()` in optim.Optimizer._finite, one per optimizer
step, and M `.tolist()` in rollout._running_counts, one per rollout: K + 1 + M = 5 here):
  inside `DMD2Trainer.cycle`: none. The non-finite skip is decided on the device (fused AdamW's found-inf),
      the rollout's stop steps are drawn on the host;
  per iteration of the training loop: ONE, `ExitController.check` reading the exit flags and the skip
      counters together (`loop.check_iteration`);
  per log interval: the metrics' `.cpu().tolist()` in `DMD2Trainer.log`.
A new sync anywhere fails CI.
"""
import collections
import os
import sys

import pytest
import torch

from dmd2_mega.arguments import parse_dmd2_args
from dmd2_mega.methods.dmd2.method import DMD2Trainer
from tests.utils import world_of_one

pytestmark = pytest.mark.timeout(120)
ROOTS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d) + os.sep
              for d in ("dmd2_mega", "kernels"))
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


def test_cycle_host_syncs_within_budget(debug_teacher, monkeypatch):
    iters = 3
    with world_of_one():
        tr = DMD2Trainer(parse_dmd2_args([
            "--model-size", "debug", "--teacher-load", debug_teacher, "--micro-batch-size", "2",
            "--global-batch-size", str(2 * M), "--dmd2-critic-steps-per-rollout", str(K),
            "--train-iters", str(1 + iters), "--log-interval", "100", "--dmd2-gan", "--ema-decay", "0.5",
            "--dmd2-teacher-guidance-scale", "2", "--no-offload-inactive"]))
        tr.cycle()  # warm-up
        counts = count_syncs(monkeypatch)
        tr.cycle()
        in_cycle = dict(counts)
        counts.clear()
        tr.train()  # cycles 3 and 4, then the one log at the last cycle
        monkeypatch.undo()
    assert in_cycle == {}, f"host syncs inside one cycle: {in_cycle} (budget: none)"
    loop = {("tolist", "resilience.py", "check"): iters - 1,
            ("cpu", "trainer.py", "log"): 1, ("tolist", "trainer.py", "log"): 1}
    assert dict(counts) == loop, f"host syncs of the loop changed: {dict(counts)} (budget {loop})"


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
