"""Soak test: many DMD2 cycles with periodic checkpoints, watching the process's resident memory.

    nice -n 10 python benchmarks/soak.py [--cycles 1000] [--save-interval 100] [--sample-every 25]
                                         [--model-size debug] [--data digits] [--results benchmarks/RESULTS.md]
    python benchmarks/soak.py --model-size wan-digits --data moving-digits   # any family, any --data

What runs: a `--model-size` teacher (any family) is pretrained in-process for 20 flow-matching steps on `--data`
(digits, moving-digits, a shard directory), then
`DMD2Trainer.train()` (the real loop, unmodified) runs `--cycles` cycles (B = 8, K = 5, teacher CFG
1.5, --offload-inactive so that every phase sleeps and wakes roles) saving student + critic every
`--save-interval` cycles into a temporary directory (deleted at the end), logging every 50.
A sampler thread reads the process RSS and its open file descriptors (psutil, from /proc) each
time the cycle count crosses a multiple of `--sample-every`. (Not `gc.get_objects()`: walking the
heap from a second thread while torch runs crashed the process in two runs.)

Report: a table (cycle, seconds, RSS MB, change since the first sample, open files) and the
growth between the mean RSS of the first and of the last quarter of the samples taken after
`--warmup` cycles (the first cycles and the first save grow the allocator's pools and torch's lazy
state once); "no growth beyond noise" when that is below max(2 MB, 1 %) (a leak of one saved
payload per checkpoint or one rollout per cycle is far above that). With --results the table and
the machine are appended to that file.
A script, not a unit test.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402
import torch  # noqa: E402

from dmd2_mega.arguments import parse_dmd2_args, parse_flow_args  # noqa: E402
from dmd2_mega.methods.dmd2.method import DMD2Trainer  # noqa: E402
from dmd2_mega.distributed.parallel import destroy_distributed  # noqa: E402
from dmd2_mega.teacher_trainer import FlowTrainer  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=1000)
    p.add_argument("--save-interval", type=int, default=100)
    p.add_argument("--sample-every", type=int, default=25)
    p.add_argument("--warmup", type=int, default=100, help="cycles left out of the growth estimate")
    p.add_argument("--model-size", default="debug", help="a registered size of any family, or a model folder")
    p.add_argument("--data", default="digits", help="digits | moving-digits | a shard directory")
    p.add_argument("--results", default=None, help="append the report to this markdown file")
    return p.parse_args()


class Sampler(threading.Thread):
    """Records (cycle, seconds, rss bytes, open fds) when trainer.iteration crosses a multiple."""

    def __init__(self, trainer: DMD2Trainer, every: int):
        super().__init__(daemon=True)
        self.trainer, self.every = trainer, every
        self.proc, self.rows, self.stop = psutil.Process(), [], threading.Event()
        self.start_time = time.time()

    def sample(self, cycle: int) -> None:
        self.rows.append((cycle, time.time() - self.start_time, self.proc.memory_info().rss, self.proc.num_fds()))

    def run(self) -> None:
        last = -1
        while not self.stop.is_set():
            it = self.trainer.iteration
            if it // self.every != last:
                last = it // self.every
                self.sample(it)
            time.sleep(0.01)


def machine() -> str:
    return (f"{platform.processor() or platform.machine()}, {psutil.cpu_count()} logical CPUs "
            f"(torch threads {torch.get_num_threads()}), {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
            f"Python {platform.python_version()}, torch {torch.__version__}, "
            f"{'CUDA ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU only'}")


def report(rows: list, args, seconds: float, saves: int) -> tuple[str, bool]:
    mb = [r[2] / 2**20 for r in rows]
    steady = [r[2] / 2**20 for r in rows if r[0] >= args.warmup] or mb
    q = max(len(steady) // 4, 1)
    first, last = sum(steady[:q]) / q, sum(steady[-q:]) / q
    growth = last - first
    ok = growth < max(2.0, 0.01 * first)
    lines = ["| cycle | seconds | RSS MB | change MB | open files |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {c} | {s:.1f} | {r / 2**20:.1f} | {r / 2**20 - mb[0]:+.1f} | {o} |" for c, s, r, o in rows]
    lines += ["", f"{args.cycles} DMD2 cycles of `--model-size {args.model_size} --data {args.data}` (B=8, K=5, "
                  f"teacher CFG 1.5, --offload-inactive) in {seconds:.0f} s, {saves} checkpoints (student + critic, "
                  f"every {args.save_interval} cycles).",
              f"Mean RSS over the first quarter of the samples after cycle {args.warmup}: {first:.1f} MB; "
              f"last quarter: {last:.1f} MB; growth {growth:+.1f} MB ({100 * growth / first:+.2f} %): "
              f"{'no growth beyond noise' if ok else 'GROWTH above the noise threshold max(2 MB, 1 %)'}.",
              f"Peak RSS {max(mb):.1f} MB; open file descriptors {rows[0][3]} -> {rows[-1][3]}."]
    return "\n".join(lines), ok


def main() -> int:
    args = parse()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = tempfile.mkdtemp(prefix="dmd2_soak_")
    try:
        teacher = os.path.join(work, "teacher")
        FlowTrainer(parse_flow_args(["--model-size", args.model_size, "--data", args.data, "--train-iters", "20",
                                     "--micro-batch-size", "16", "--lr", "3e-3", "--log-interval", "20",
                                     "--save", teacher])).train()
        tr = DMD2Trainer(parse_dmd2_args([
            "--model-size", args.model_size, "--data", args.data, "--teacher-load", teacher, "--micro-batch-size", "8",
            "--dmd2-critic-steps-per-rollout", "5", "--dmd2-teacher-guidance-scale", "1.5", "--lr", "1e-4",
            "--train-iters", str(args.cycles), "--save", os.path.join(work, "student"),
            "--save-interval", str(args.save_interval), "--log-interval", "50", "--offload-inactive"]))
        sampler = Sampler(tr, args.sample_every)
        sampler.start()
        start = time.time()
        tr.train()
        seconds = time.time() - start
        sampler.stop.set()
        sampler.join()
        if sampler.rows[-1][0] != tr.iteration:
            sampler.sample(tr.iteration)
        saves = len([n for n in os.listdir(os.path.join(work, "student")) if n.startswith("iter_")])
    finally:
        destroy_distributed()
        shutil.rmtree(work, ignore_errors=True)
    table, ok = report(sampler.rows, args, seconds, saves)
    print(f"\nmachine: {machine()}\n\n{table}")
    if args.results:
        with open(args.results, "a") as f:
            f.write(f"\n## Soak: {args.cycles} DMD2 cycles with periodic saves (benchmarks/soak.py, issue 6)\n\n"
                    f"{datetime.date.today()}, `nice -n 10 python benchmarks/soak.py --model-size {args.model_size} "
                    f"--data {args.data} --cycles {args.cycles} --save-interval {args.save_interval} "
                    f"--sample-every {args.sample_every} --warmup {args.warmup}`; "
                    f"machine: {machine()}.\n\n{table}\n")
        print(f"appended to {args.results}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
