"""Quality ablation on digits: what DMD2's GAN head and the student EMA buy, at a fixed wall clock.

    python benchmarks/quality_ablation.py --teacher-load runs/quickstart/teacher \
        [--out runs/ablation] [--budget-4step 240] [--budget-1step 170] [--seeds 1 2 3] \
        [--configs dmd gan gan_ema] [--add-config NAME:LABEL:FLAGS] [--jobs 2 --threads 1] \
        [--results benchmarks/RESULTS.md]

Cells: the 4-step and the 1-step student x {DMD only, DMD + GAN, DMD + GAN + EMA} x seeds, each
distilled from the same teacher by `launch/pretrain_dmd2.py` with the quickstart's settings (digits
DiT, B = 64, K = 5, lr 1e-4 (4-step) / 6e-4 (1-step) -> 1e-5 cosine, teacher CFG 1.25 in the real score)
plus the cell's flags (`CONFIGS`, and any --add-config: a named cell of further flags, later ones winning, e.g.
`--add-config "k2:DMD only, K = 2:--dmd2-critic-steps-per-rollout 2"`). Fixed wall clock: a 6-cycle calibration
run of each (steps, flags) pair measures the seconds per cycle (the mean of cycles 3-6), and the cell runs
floor(budget / that) cycles, so that its LR schedule ends where its time does; a cell that runs
slow (a busy machine) still stops at --guard (2) x its budget (--exit-duration-in-mins, saved). Each student
then samples --num-samples (2000) class-balanced digits (`launch/sample.py`, seed 0, EMA weights when kept) scored
by `dmd2_mega.eval.digits` (Frechet distance of classifier features to held-out digits, class
accuracy, diversity relative to real), next to the teacher at 50/4/1 Euler steps (CFG 1.25).
Prints a per-run table and a mean-per-cell table (mean, sample standard deviation and each seed; Markdown);
--results appends both to a file. --jobs J distils J cells at once, every run (calibrations included) on --threads
threads, so that the calibrated cycle counts hold while J run side by side.
Resumable: a finished cell (its samples.npz exists) is not run again, and the seconds per cycle are kept in
OUT/calibration.json (per steps and flags) and reused, so that a resumed cell runs the cycles its finished seeds ran
(a second calibration on a machine of changing load gave 0.619 s where the first gave 0.530); --recalibrate measures
again. A script, not a unit test.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from dmd2_mega.eval.report import SEED_MARK, seed_means  # noqa: E402

# The GAN's input noise is drawn from unshifted sigma in [0.05, 0.3], not the whole score range: on
# digits the head barely learned in 300 cycles with noise up to 0.98 (D loss 1.386 -> 1.381), and
# with clean inputs it won outright (D loss 0.02; real digits have 17 grey levels, a give-away),
# costing the 1-step student diversity (0.85 -> 0.77). The head starts from scratch: at the critic's lr (1e-4) it
# learned little in 300 cycles (logit gap 0.01); at 100x (1e-2) the gap reached ~0.05-0.1. Generator weight 3e-2
# (1e-2 moved little, 1e-1 overpowered the DMD gradient: actor grad norm 6, FD 1.89 against 1.73; 4-step probes,
# seed 1, 300 cycles, benchmarks/RESULTS.md). Since issue 54 the head is the conv head on the token grid
# (`--dmd2-gan-head conv`, weight decay 0.01, clip 10): the offline probe (benchmarks/gan_probe.py) trained it as
# well at 1e-4 as at 1e-3, so its lr is 3x the critic's (3e-4 for the 4-step student, 1.8e-3 for the 1-step).
GAN = ["--dmd2-gan", "--dmd2-gan-head", "conv", "--dmd2-gan-sigma-range", "0.05", "0.3", "--dmd2-gan-gen-weight",
       "3e-2", "--dmd2-gan-head-lr-mult", "3"]
CONFIGS = {  # name -> (label, extra flags of launch/pretrain_dmd2.py)
    "dmd": ("DMD only", []),
    "gan": ("DMD + GAN", GAN),
    "gan_ema": ("DMD + GAN + EMA", GAN + ["--ema-decay", "0.95", "--ema-start-iter", "100"]),
}
GUIDANCE = 1.25  # the teacher's CFG in DMD2's real score, both students (the quickstart's)
LR = {4: "1e-4", 1: "6e-4"}  # peak learning rate by student steps (the quickstart's)


def added_config(text: str) -> tuple:
    """--add-config NAME:LABEL:FLAGS -> (NAME, (LABEL, [flag, ...]))."""
    parts = text.split(":", 2)
    if len(parts) != 3 or not parts[0] or not parts[1] or not parts[2].split():
        raise argparse.ArgumentTypeError(f"expected NAME:LABEL:FLAGS (e.g. \"k2:K = 2:--dmd2-critic-steps-per-rollout "
                                         f"2\"), got {text!r}")
    return parts[0], (parts[1], parts[2].split())


def base_args(teacher: str, steps: int, seed: int) -> list:
    return ["--model-size", "digits", "--data", "digits", "--teacher-load", teacher,
            "--dmd2-denoising-steps", str(steps), "--dmd2-critic-steps-per-rollout", "5",
            "--dmd2-teacher-guidance-scale", str(GUIDANCE), "--micro-batch-size", "64",
            "--global-batch-size", "64", "--lr", LR[steps], "--min-lr", "1e-5", "--clip-grad", "1.0",
            "--seed", str(seed)]


def run(cmd: list, log: str, threads: int = 0) -> str:
    """Run `cmd` (stdout + stderr into `log`; `threads` > 0: OMP_NUM_THREADS); raise with the log's tail if it fails."""
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    text = open(log).read()
    if rc != 0:
        raise SystemExit(f"error: {' '.join(cmd[:3])} ... exited {rc}; see {log}:\n{text[-3000:]}")
    return text


def seconds_per_cycle(a, out: str, steps: int, cfg: str, extra: list) -> float:
    log = os.path.join(out, f"calibrate_{steps}step_{cfg}.log")
    text = run([sys.executable, "launch/pretrain_dmd2.py", *base_args(a.teacher_load, steps, 1), *extra,
                "--train-iters", "6", "--log-interval", "1", "--loss-trace", log + ".jsonl"], log, a.threads)
    ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", text)]
    if len(ms) < 6:
        raise SystemExit(f"error: calibration log {log} has {len(ms)} timed cycles, expected 6")
    return sum(ms[2:]) / len(ms[2:]) / 1000.0


def score(npz: str) -> dict:
    from dmd2_mega.eval.digits import evaluate_digits
    import numpy as np
    with np.load(npz) as z:
        return evaluate_digits(z["images"], z["labels"])


def sample(load: str, out: str, extra: list, n: int, threads: int = 0) -> dict:
    npz = os.path.join(out, "samples.npz")
    if not os.path.exists(npz):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        run([sys.executable, "launch/sample.py", "--load", load, "--num-samples", str(n), "--seed", "0",
             "--out", out, *extra], out + ".log", threads)
    return score(npz)


def cell(a, extra_all: list, steps: int, cfg: str, seed: int, iters: int, budget: float) -> dict:
    """Distil one cell for `iters` cycles (resumable: its <save>.json marks it done), sample and score it."""
    label, flags = a.cells[cfg]
    name = f"{steps}step_{cfg}_seed{seed}"
    save = os.path.join(a.out, name)
    info_path = save + ".json"
    if not os.path.exists(info_path):
        t0 = time.time()
        run([sys.executable, "launch/pretrain_dmd2.py", *base_args(a.teacher_load, steps, seed), *flags,
             *extra_all, "--train-iters", str(iters), "--save", save, "--save-interval", str(iters),
             "--log-interval", "25", "--exit-duration-in-mins", str(a.guard * budget / 60)], save + ".log", a.threads)
        done = int(open(os.path.join(save, "latest_checkpointed_iteration.txt")).read())
        with open(info_path, "w") as f:
            json.dump({"cycles": done, "planned": iters, "seconds": time.time() - t0}, f)
    info = json.load(open(info_path))
    r = sample(save, os.path.join(a.out, "samples", name), [], a.num_samples, a.threads)
    print(f"> {name}: {info['cycles']} cycles in {info['seconds']:.0f} s, FD {r['frechet_distance']:.3f}, "
          f"acc {100 * r['class_accuracy']:.1f}%, diversity {r['diversity']:.2f}", flush=True)
    return {"steps": steps, "config": label, "seed": seed, **info, **r}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher-load", required=True)
    p.add_argument("--out", default="runs/ablation")
    p.add_argument("--budget-4step", type=float, default=240.0, help="seconds of distillation per 4-step cell")
    p.add_argument("--budget-1step", type=float, default=170.0, help="seconds of distillation per 1-step cell")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--jobs", type=int, default=1, help="cells distilled at once (each on --threads threads)")
    p.add_argument("--threads", type=int, default=0,
                   help="OMP_NUM_THREADS of every run, calibration included (0: the environment's)")
    p.add_argument("--num-samples", type=int, default=2000,
                   help="samples per row (500 gives Frechet distances that vary by ~0.4 between sampling seeds)")
    p.add_argument("--guard", type=float, default=2.0,
                   help="a cell that runs slower than calibrated stops at guard x its budget (saved)")
    p.add_argument("--steps", type=int, nargs="+", default=[1, 4])
    p.add_argument("--configs", nargs="+", default=None,
                   help=f"cells to run (default {' '.join(CONFIGS)} and every --add-config)")
    p.add_argument("--add-config", type=added_config, action="append", default=[], metavar="NAME:LABEL:FLAGS",
                   help="one more cell: its name, its table label and its pretrain_dmd2.py flags, in one string")
    p.add_argument("--extra", default="", help="further pretrain_dmd2.py flags for every cell (one string)")
    p.add_argument("--results", default=None, help="append the tables to this Markdown file")
    p.add_argument("--recalibrate", action="store_true",
                   help="measure the seconds per cycle again, not reuse OUT/calibration.json's")
    a = p.parse_args(argv)
    a.cells = {**CONFIGS, **dict(a.add_config)}
    a.configs = a.configs or list(a.cells)
    unknown = [c for c in a.configs if c not in a.cells]
    if unknown:
        p.error(f"--configs {' '.join(unknown)}: no such cell (known: {', '.join(a.cells)}; --add-config adds one)")
    os.makedirs(a.out, exist_ok=True)
    if not os.path.exists(os.path.join(a.teacher_load, "latest_checkpointed_iteration.txt")):
        raise SystemExit(f"error: --teacher-load {a.teacher_load} holds no checkpoint (run launch/quickstart.sh "
                         f"or launch/pretrain_flow.py first)")
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    extra_all = a.extra.split()
    rows = []
    teacher_out = os.path.join(a.out, "teacher")
    for n in (50, 4, 1):
        r = sample(a.teacher_load, os.path.join(teacher_out, f"{n}step"), ["--steps", str(n), "--guidance", "1.25"],
                   a.num_samples)
        rows.append({"model": f"teacher, {n} Euler steps, CFG 1.25", **r})
        print(f"> teacher {n} steps: FD {r['frechet_distance']:.3f}", flush=True)
    jobs = []  # (steps, config, seed, iters, budget): every cell, calibrated before any runs
    saved_path = os.path.join(a.out, "calibration.json")
    saved = {}
    if not a.recalibrate and os.path.exists(saved_path):
        with open(saved_path) as f:
            saved = json.load(f)
    for steps in a.steps:
        budget = a.budget_4step if steps == 4 else a.budget_1step
        for cfg in a.configs:  # cells of the same steps and flags share one calibration
            label, flags = a.cells[cfg]
            key = f"{steps}-step: {' '.join(flags + extra_all)}"
            if key in saved:
                print(f"> {steps}-step {label}: {saved[key]:.3f} s per cycle ({saved_path})", flush=True)
            else:
                saved[key] = seconds_per_cycle(a, a.out, steps, cfg, flags + extra_all)
                print(f"> {steps}-step {label}: {saved[key]:.3f} s per cycle", flush=True)
                with open(saved_path, "w") as f:
                    json.dump(saved, f, indent=1)
            jobs += [(steps, cfg, seed, max(1, int(budget // saved[key])), budget) for seed in a.seeds]
    with ThreadPoolExecutor(a.jobs) as pool:  # --jobs cells at once, each on --threads threads
        cells = list(pool.map(lambda job: cell(a, extra_all, *job), jobs))
    text = report(rows, cells, a)
    print(text)
    with open(os.path.join(a.out, "ablation.json"), "w") as f:
        json.dump({"teacher": rows, "cells": cells}, f, indent=1)
    if a.results:
        with open(a.results, "a") as f:
            command = "python benchmarks/quality_ablation.py " + " ".join(argv or sys.argv[1:])
            f.write(f"\n## Quality ablation ({datetime.date.today()}, {platform.processor() or platform.machine()}, "
                    f"{os.cpu_count()} cores)\n\n`{command}`\n\n{text}\n")
    return 0


def report(rows: list, cells: list, a) -> str:
    floor = rows[0]["frechet_floor"]
    head = [f"| model | cycles (wall s) | Frechet distance (floor {floor:.3f}) | class accuracy | diversity |",
            "|---|---|---|---|---|"]
    per_run = head + [f"| {r['model']} | - | {r['frechet_distance']:.3f} | {100 * r['class_accuracy']:.1f}% | "
                      f"{r['diversity']:.2f} |" for r in rows]
    # named "LABEL @ seed S", so that the mean-per-cell table is eval.report's of the quickstart's SEEDS
    named = [(f"{c['steps']}-step, {c['config']}{SEED_MARK}{c['seed']}", c) for c in cells]
    per_run += [f"| {name} | {c['cycles']} ({c['seconds']:.0f}) | {c['frechet_distance']:.3f} | "
                f"{100 * c['class_accuracy']:.1f}% | {c['diversity']:.2f} |" for name, c in named]
    means = seed_means(named)
    budgets = f"budgets: 4-step {a.budget_4step:.0f} s, 1-step {a.budget_1step:.0f} s per run"
    return "\n".join(per_run) + "\n\n" + budgets + ("\n\n" + means if means else "")


if __name__ == "__main__":
    sys.exit(main())
