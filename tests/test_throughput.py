"""Per-phase time and model TFLOP/s in the log (dmd2_mega/plan/throughput.py; issue 16, item 6).

  a. PhaseClock on a CPU, with time.perf_counter replaced by a scripted clock: each phase gets the time from its
     start to the next mark, averaged over the cycles since the last take; take() then starts afresh.
  b. The FLOP counts are the planner's forward FLOPs (checked exactly against torch's FlopCounterMode in
     tests/test_plan_memory.py) times the passes of a step: 3 per flow-matching micro-batch; for a DMD2 cycle
     K (N + 1) / 2 + 3K + teacher (2 with CFG) [+ 1 original scoring] + 3.
  c. A logged line (launch/pretrain_flow.py, debug DiT, in-process): its model TFLOP/s equals the step's FLOPs
     over its elapsed time per iteration (to the printed digits).
"""
import re

import pytest

from dmd2_mega.plan import memory_plan as mp
from dmd2_mega.plan import throughput
from dmd2_mega.train.builders import data_info
from dmd2_mega.data import build_dataset
from tests.utils import PRETRAIN, python


def test_phase_clock_averages_each_phase(monkeypatch):
    ticks = iter([0.0, 1.0, 3.0, 6.0,      # cycle 1: rollout 1 s, critic 2 s, actor 3 s
                  10.0, 13.0, 14.0, 19.0])  # cycle 2: rollout 3 s, critic 1 s, actor 5 s
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: next(ticks))
    import torch
    clock = throughput.PhaseClock(torch.device("cpu"))
    for _ in range(2):
        for phase in ("rollout", "critic", "actor"):
            clock(phase)
        clock.end_cycle()
    assert clock.take() == {"rollout": 2.0, "critic": 1.5, "actor": 4.0}
    assert clock.take() == {}


def test_step_flops_are_forward_flops_times_passes():
    info = data_info(build_dataset("digits"))
    f = mp.forward_flops(mp.model_shape_from_info("debug", info), 1, 1)
    assert throughput.sample_flops("debug", info, 1) == f
    assert throughput.flow_step_flops(f, 8, 2) == 3 * f * 8 * 2
    k, n, b, m = 5, 4, 8, 2
    shared = k * (n + 1) / 2 + 3 * k + 2 + 3  # CFG doubles the teacher's pass
    assert throughput.dmd2_cycle_flops(f, b, m, k, n, 1.5, "shared") == pytest.approx(shared * f * b * m)
    original = k * (n + 1) / 2 + 3 * k + 1 + 1 + 3  # no CFG: one teacher pass; 'original': one critic pass
    assert throughput.dmd2_cycle_flops(f, b, m, k, n, 1.0, "original") == pytest.approx(original * f * b * m)


@pytest.mark.integration
def test_logged_tflops_is_step_flops_over_elapsed_time(tmp_path):
    res = python(PRETRAIN, ["--model-size", "debug", "--train-iters", "4", "--micro-batch-size", "8",
                            "--global-batch-size", "16", "--log-interval", "2"])
    res.check("pretrain_flow")
    f = mp.forward_flops(mp.model_shape_from_info("debug", data_info(build_dataset("digits"))), 1, 1)
    lines = [ln for ln in res.stdout.splitlines() if "model TFLOP/s per GPU" in ln]
    assert len(lines) == 2, res.stdout[-2000:]
    for ln in lines:
        ms = float(re.search(r"elapsed time per iteration \(ms\): ([0-9.]+)", ln).group(1))
        tflops = float(re.search(r"model TFLOP/s per GPU: ([0-9.e+-]+)", ln).group(1))
        want = 3 * f * 16 / (ms / 1000) / 1e12
        rel = 0.05 / ms + 5e-4  # ms is printed to 0.1, TFLOP/s to 4 significant digits
        assert tflops == pytest.approx(want, rel=rel), (ln, want)
