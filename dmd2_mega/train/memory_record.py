"""What a distillation run held in memory, measured: the peak of the roles' resident bytes over the phases of its
cycles and the process's peak resident set, logged at the end and written beside the checkpoints.

`PeakResident` takes each cycle's {phase: bytes} (`roles.enter_phase`: the weights, grads, optimizer state and
EMA of every role on the device, each storage counted once, so LoRA roles over the teacher's weights add only
their adapters) and keeps the maximum per phase: Python ints, no host sync. `process_peak_rss()` is the kernel's
high-water mark of this process's resident set (activations, the data, the libraries included).
`write(save_dir, ...)` puts both in <save>/memory.json (main rank; this rank's figures), which
`python -m dmd2_mega.eval.memory_table` prints for several runs (the quickstarts' full vs LoRA rows).
"""
from __future__ import annotations

import json
import os
import resource
import sys
from typing import Optional

from dmd2_mega.files.atomic import atomic_write

MEMORY_FILE = "memory.json"


def process_peak_rss() -> int:
    """Bytes: the peak resident set of this process so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


class PeakResident:
    def __init__(self) -> None:
        self.per_phase: dict[str, int] = {}

    def update(self, resident: dict) -> None:
        for phase, nbytes in resident.items():
            self.per_phase[phase] = max(self.per_phase.get(phase, 0), int(nbytes))

    def peak(self) -> tuple[Optional[str], int]:
        """(the phase of the largest resident bytes, those bytes); (None, 0) before any cycle."""
        if not self.per_phase:
            return None, 0
        phase = max(self.per_phase, key=self.per_phase.get)
        return phase, self.per_phase[phase]

    def summary(self, trainable: int, device: str) -> dict:
        phase, nbytes = self.peak()
        return {"peak_resident_bytes": nbytes, "peak_phase": phase, "resident_bytes_per_phase": dict(self.per_phase),
                "process_peak_rss_bytes": process_peak_rss(), "trainable_parameters": trainable, "device": device}

    @staticmethod
    def describe(summary: dict) -> str:
        mib = 2 ** 20
        return (f"peak resident {summary['peak_resident_bytes'] / mib:.2f} MiB in the {summary['peak_phase']} phase "
                f"(weights, grads, optimizer state and EMA of every role, each storage once); process peak RSS "
                f"{summary['process_peak_rss_bytes'] / mib:.0f} MiB")


def write(save_dir: str, summary: dict) -> str:
    path = os.path.join(save_dir, MEMORY_FILE)
    atomic_write(path, lambda f: json.dump(summary, f, indent=1), text=True)
    return path
