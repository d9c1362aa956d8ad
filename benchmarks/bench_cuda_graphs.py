"""A DMD2 cycle with `--cuda-graphs` against the same cycle eager, in one run, beside a plain training step.

    python benchmarks/bench_cuda_graphs.py [bench_dmd2_cycle.py's flags: --model-size, --data, --micro-batch-size,
                                            --bf16, ...] [--warmup 2] [--repeats 5] [--csv F]

One trainer (benchmarks/bench_dmd2_cycle.Harness: offload off, the run's compile default); the cycles run round-robin,
eager then graphed, each at the same cycle index (the same data and draws). The graphed cycles route every model call
of the cycle through `models.cuda_graphs` (what `--cuda-graphs` installs); their warm-up cycles capture the graphs
(the rollout's running counts are captured as they first appear, so a later warm-up cycle may still capture one:
the count of graphs is printed per cycle). Printed: ms per cycle, eager and graphed (medians), their ratio, the plain
step, cycles as plain steps, the graphs captured and the peak device memory of each. Both paths step one trainer, so
their numbers are not compared here: tests/test_cuda_graphs.py compares a graphed run with an eager one.
On a CPU there are no graphs: the graphed path runs `cuda_graphs.EmulatedCapture` (eager, with a graph's
output-overwriting semantics), a dry run that checks the plumbing; its times mean nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.bench_dmd2_cycle import Harness, add_flags, harnessed  # noqa: E402
from dmd2_mega.models import cuda_graphs  # noqa: E402


def parse_args(argv=None):
    return add_flags(argparse.ArgumentParser(description=__doc__.split("\n")[0])).parse_args(argv)


def main(argv=None):
    harnessed(parse_args(argv), run, "bench_graphs_")


def run(a, bench: Harness) -> None:
    models = {name: r.model for name, r in bench.tr.roles.items()}
    cuda_graphs.install(models, cuda_graphs.CudaCapture() if bench.cuda else cuda_graphs.EmulatedCapture())
    times: dict = {"eager": [], "graphed": [], "plain": []}
    peaks: dict = {"eager": 0, "graphed": 0}
    captured = []
    for rep in range(a.warmup + a.repeats):
        for path in ("eager", "graphed"):
            bench.at(rep)
            if bench.cuda:
                torch.cuda.reset_peak_memory_stats(bench.dev)
            with cuda_graphs.capturing() if path == "graphed" else contextlib.nullcontext():
                ms = bench.timed(lambda mark: bench.cycle("shared", mark))["all"]
            if bench.cuda:
                peaks[path] = max(peaks[path], torch.cuda.max_memory_allocated(bench.dev))
            if rep >= a.warmup:
                times[path].append(ms)
        captured.append(sum(cuda_graphs.CAPTURED.values()))
        ms = bench.timed(lambda mark: bench.plain.train_step())["all"]
        if rep >= a.warmup:
            times["plain"].append(ms)
    med = {k: statistics.median(v) for k, v in times.items()}
    dev = (torch.cuda.get_device_name(bench.dev) if bench.cuda else
           "CPU (emulated graphs: a dry run, times mean nothing)")
    print(f"device: {dev} | torch {torch.__version__} | {a.model_size} | B={bench.b} K={bench.k} "
          f"N={a.dmd2_denoising_steps} | {'bf16' if a.bf16 else 'fp32'} | median of {a.repeats} after {a.warmup}")
    kinds = ", ".join(f"{r} {'grad' if g else 'no-grad'} {n}" for (r, g), n in sorted(cuda_graphs.CAPTURED.items()))
    print(f"graphs captured after each cycle: {captured} ({kinds})")
    rows = [("cycle eager ms", med["eager"]), ("cycle graphed ms", med["graphed"]),
            ("graphed / eager", med["graphed"] / med["eager"]), ("plain step ms", med["plain"]),
            ("eager cycle in plain steps", med["eager"] / med["plain"]),
            ("graphed cycle in plain steps", med["graphed"] / med["plain"]),
            ("peak MiB eager", peaks["eager"] / 2**20), ("peak MiB graphed", peaks["graphed"] / 2**20)]
    print("\n".join(f"{k:>34}: {v:.4g}" for k, v in rows))
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            csv.writer(f).writerows([["device", "name", "value"]] + [[dev, k, v] for k, v in rows])
        print(f"wrote {a.csv}")
    cuda_graphs.uninstall(models.values())


if __name__ == "__main__":
    main()
