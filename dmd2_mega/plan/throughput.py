"""Per-phase time and model TFLOP/s per GPU for the log line.

`PhaseClock` is the phase hook of a method's cycle (`methods.dmd2.cycle.run_cycle`): it marks each phase's start and the cycle's end. On CUDA the
marks are CUDA events, recorded on the stream without a host sync and read at log time (`take`, which waits for
the last one: the log already syncs once per interval); on a CPU, where ops run synchronously, they are
`time.perf_counter()`.

Model FLOPs are analytic, per GPU (TP rank), from `memory_plan.forward_flops`: the family's matmuls, attention
with its sequence length, cross-attention and the MLP; a backward counts twice a forward. Recomputation
(`--recompute-granularity full`) is not counted: these are model FLOPs, as Megatron reports them, not hardware
FLOPs. Per micro-batch of B samples, in forwards F of B samples (`memory_plan.cycle_passes`): a flow-matching
step 3F; a DMD2 cycle K (N + 1) / 2 F of rollout (its expectation over the stop steps), 3KF of critic steps,
the teacher's F (2F with CFG) and with 'original' scoring a critic F, and 3F of actor. The GAN head's passes
are not counted.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from dmd2_mega.plan import memory_plan as mp
from dmd2_mega.train.logger import print_rank0


class PhaseClock:
    """Wall time per phase of each cycle; `take()` -> {phase: mean seconds per cycle} since the last take."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._marks: list = []
        self._cycles: list = []

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def __call__(self, phase: str) -> None:
        """`run_cycle`'s hook: `phase` starts now."""
        self._marks.append((phase, self._now()))

    def end_cycle(self) -> None:
        self._marks.append((None, self._now()))
        self._cycles.append(self._marks)
        self._marks = []

    def take(self) -> dict:
        if not self._cycles:
            return {}
        if self.cuda:
            self._cycles[-1][-1][1].synchronize()
        totals: dict = {}
        for marks in self._cycles:
            for (phase, a), (_, b) in zip(marks, marks[1:]):
                seconds = a.elapsed_time(b) / 1000 if self.cuda else b - a
                totals[phase] = totals.get(phase, 0.0) + seconds
        n = len(self._cycles)
        self._cycles = []
        return {phase: s / n for phase, s in totals.items()}


def sample_flops(size: str, info: dict, tp: int, cp: int = 1, rank: int = 0) -> Optional[int]:
    """Forward FLOPs of one sample per GPU (TP splits the heads and MLP, CP the tokens), or None (printed once)
    where the planner cannot shape the model."""
    try:
        return mp.forward_flops(mp.model_shape_from_info(size, info), 1, tp) // cp
    except (ValueError, KeyError, TypeError) as e:
        print_rank0(f"> WARNING: no model FLOPs for --model-size {size} ({e}); the log shows no TFLOP/s", rank)
        return None


def flow_step_flops(per_sample: int, micro: int, num_micro: int) -> int:
    """Model FLOPs of one flow-matching step per GPU: forward + backward of every micro-batch."""
    return 3 * per_sample * micro * num_micro


def dmd2_cycle_flops(per_sample: int, micro: int, num_micro: int, steps: int, denoise: int, guidance: float,
                     scoring: str) -> float:
    """Model FLOPs of one DMD2 cycle per GPU (module docstring)."""
    passes = mp.cycle_passes(steps, denoise, guidance, scoring, recompute=False)
    return passes["cycle"] * per_sample * micro * num_micro
