"""Benchmark of one Self-Forcing DMD cycle against its analytic minimum, on one rank (issue 30, item 4).

    python benchmarks/bench_self_forcing_cycle.py [--model-size wan-digits] [--data moving-digits:8] \
        [--micro-batch-size 16] [--dmd2-denoising-steps 4] [--dmd2-critic-steps-per-rollout 5] \
        [--causal-chunk-frames 2] [--dmd2-teacher-guidance-scale 2] [--recompute-granularity full] [--repeats 5]
    # the streaming ratio (time per chunk at 2T / T with the rolling window): benchmarks/bench_streaming.py

What is timed is the product's own code: the teacher trainer (`teacher_trainer.FlowTrainer`) builds a random
--model-size model on --data, perturbs its weights by N(0, 0.02^2) and saves it as the teacher; the shared student
trainer (`methods.trainer.StudentTrainer`) runs `SelfForcingMethod` (--distill-method self-forcing --causal: the
causal student initialised from the teacher, bidirectional critic and teacher; M = 1, no DDP, offload off), and a
cycle is the method's `cycle` on the trainer's roles and micro-batch records, its phases (rollout, critic, actor)
timed through the cycle's hook. Baselines measured in the same run, round-robin with the cycle: a plain
flow-matching step of B clips (`FlowTrainer.train_step`, the bidirectional model: what one critic step is) and F,
one no-grad forward of B whole clips. Each phase is also timed alone: the method's own step
(`SelfForcingMethod.steps`) run by `benchmarks.pieces.Pieces` on the micro-batch records and input it has inside a
cycle (the same draws), so `in cycle / alone` shows what the cycle adds around a phase.

Cost model, in F (C chunks; q = the share of the clip's frames outside the last chunk; e_c the drawn exit steps):
    rollout  K*B clips: each chunk runs e_c + 1 forwards of its frames, and every chunk but the last one more
             to write its k / v at the context level: drawn = sum_c (e_c + 1) f_c / F over the clips, + K q
    critic   K plain steps (the bidirectional critic, as DMD2's) + the teacher's scoring: 2F with CFG, else 1F
    actor    the replay: each chunk's exit forward with grad and the whole clip's backward (one plain step) + q F
             for the earlier chunks' cache writes (no grad)
The analytic minimum costs the K + 1 steps at the measured plain step and the forward-only passes at the
measured F; `cycle / analytic minimum` is the acceptance ratio (<= 1.1). A chunked forward against the cache
versus one parallel pass (`stream / F`) shows what chunking itself costs. CUDA events are not used: the clock is
perf_counter with a device sync at each mark (CUDA); medians over --repeats after --warmup.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.pieces import Pieces  # noqa: E402
from dmd2_mega.arguments import parse_dmd2_args, parse_flow_args  # noqa: E402
from dmd2_mega.methods.self_forcing.method import SelfForcingMethod  # noqa: E402
from dmd2_mega.methods.trainer import StudentTrainer  # noqa: E402
from dmd2_mega.plan.memory_plan import format_table  # noqa: E402
from dmd2_mega.teacher_trainer import FlowTrainer  # noqa: E402

PHASES = ("rollout", "critic", "actor")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-size", default="wan-digits")
    p.add_argument("--data", default="moving-digits:8")
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--dmd2-denoising-steps", type=int, default=4)
    p.add_argument("--dmd2-critic-steps-per-rollout", type=int, default=5)
    p.add_argument("--dmd2-teacher-guidance-scale", type=float, default=2.0)
    p.add_argument("--causal-chunk-frames", type=int, default=2)
    p.add_argument("--recompute-granularity", default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads on a CPU (default: torch's)")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


class Harness:
    def __init__(self, a, tmp: str):
        self.a, self.k, self.b = a, a.dmd2_critic_steps_per_rollout, a.micro_batch_size
        common = ["--model-size", a.model_size, "--data", a.data, "--micro-batch-size", str(self.b),
                  "--seed", str(a.seed), "--lr", "1e-5", "--train-iters", "1000", "--log-interval", "1000"]
        common += ["--recompute-granularity", a.recompute_granularity] if a.recompute_granularity else []
        teacher = os.path.join(tmp, "teacher")
        self.plain = FlowTrainer(parse_flow_args(common + ["--save", teacher]))  # also the plain-step baseline
        g = torch.Generator().manual_seed(a.seed)
        with torch.no_grad():
            [p.add_(0.02 * torch.randn(p.shape, generator=g).to(p)) for p in self.plain.model.parameters()]
        self.plain.save()
        self.tr = StudentTrainer(parse_dmd2_args(common + [
            "--teacher-load", teacher, "--no-offload-inactive", "--distill-method", "self-forcing", "--causal",
            "--causal-chunk-frames", str(a.causal_chunk_frames), "--dmd2-denoising-steps", str(a.dmd2_denoising_steps),
            "--dmd2-critic-steps-per-rollout", str(self.k),
            "--dmd2-teacher-guidance-scale", str(a.dmd2_teacher_guidance_scale)]), SelfForcingMethod)
        self.dev = self.tr.ps.device
        self.shape = self.tr.shape
        self.spans = self.tr.roles["student"].model.causal_layout.chunks(self.shape[1])
        self.forwards, self.exits = [], []

    def sync(self):
        self.dev.type == "cuda" and torch.cuda.synchronize(self.dev)

    def timed(self, fn) -> dict:
        """{'all', and each span a mark(name) opened: ms} of one fn(mark)."""
        marks = []

        def mark(name):
            self.sync()
            marks.append((name, time.perf_counter()))
        mark("all")
        fn(mark)
        mark("end")
        spans = {n: (e - s) * 1e3 for (n, s), (_, e) in zip(marks[1:-1], marks[2:])}
        return {**spans, "all": (marks[-1][1] - marks[0][1]) * 1e3}

    def cycle(self, mark) -> None:
        """One Self-Forcing cycle (the method's own) at this iteration's learning rates."""
        tr = self.tr
        for name in ("student", "critic"):
            tr.roles[name].schedule.apply(tr.roles[name].optimizer, tr.iteration)
        result = tr.method.cycle(tr.roles, tr.micro_batches(), hook=mark)
        tr.state = replace(tr.state, iteration=tr.iteration + 1)
        self.forwards.append(result.rollout_forwards)

    def pieces(self) -> dict:
        """The baselines: a plain flow-matching step, F, and a whole clip streamed chunk by chunk (no grad)."""
        g = torch.Generator().manual_seed(self.a.seed)
        x = torch.randn(self.b, *self.shape, generator=g).to(self.dev)
        sigma = torch.rand(self.b, generator=g).to(self.dev)
        cond = self.tr.micro_batches()[0].cond[:self.b]
        teacher, student = self.tr.roles["teacher"].model, self.tr.roles["student"].model

        def stream(mark):  # each chunk once against the cache, then its write (all but the last): the replay's shape
            cache = student.new_cache()
            for c, (s, e) in enumerate(self.spans):
                student.stream_forward(x[:, :, s:e], sigma, cond, cache)
                if c < len(self.spans) - 1:
                    student.stream_forward(x[:, :, s:e], sigma, cond, cache, write=True)
        no_grad = torch.no_grad()
        alone = Pieces(self.tr.method.steps(), self.tr.roles, self.tr.micro_batches())  # the method's own steps
        return {"plain": lambda mark: self.plain.train_step(), "F": no_grad(lambda mark: teacher(x, sigma, cond)),
                "stream": no_grad(stream), **{f"{ph} alone": (lambda mark, ph=ph: alone.run(ph)) for ph in PHASES}}


def report(a, bench: Harness, med: dict) -> None:
    k, b = bench.k, bench.b
    frames = bench.shape[1]
    q = (frames - (bench.spans[-1][1] - bench.spans[-1][0])) / frames  # the clip outside the last chunk
    drawn = torch.stack(bench.forwards).float().mean().item() / b  # exit forwards of the K*B clips, in F
    scoring = 2.0 if a.dmd2_teacher_guidance_scale != 1.0 else 1.0
    p = med["plain"] / med["F"]  # a plain step in F, as measured
    minimum = {"rollout": (drawn + k * q) * med["F"], "critic": k * med["plain"] + scoring * med["F"],
               "actor": med["plain"] + q * med["F"]}
    floor = k + 1 + (drawn + k * q + scoring + q) / p  # in plain steps
    cycle = med["all"] / med["plain"]
    dev = torch.cuda.get_device_name(bench.dev) if bench.dev.type == "cuda" else \
        f"CPU ({torch.get_num_threads()} torch threads, {os.cpu_count()} cores, load avg {os.getloadavg()[0]:.1f})"
    print(f"device: {dev} | torch {torch.__version__} | {a.model_size} | {a.data} {'x'.join(map(str, bench.shape))} | "
          f"B={b} K={k} N={a.dmd2_denoising_steps} g={a.dmd2_teacher_guidance_scale} | {len(bench.spans)} chunks of "
          f"{[e - s for s, e in bench.spans]} frames (q = {q:.3f}) | recompute {a.recompute_granularity or 'none'} | "
          f"median of {a.repeats}")
    print(f"cost model: rollout (drawn exit forwards {drawn:.2f}F + K q = {k * q:.2f}F cache writes), critic K plain "
          f"steps + {scoring:g}F scoring, actor one plain step + q F; plain step = {p:.2f}F measured")
    rows = [[ph, med[ph], minimum[ph], med[ph] / minimum[ph], med[f"{ph} alone"]] for ph in PHASES]
    rows += [["cycle", med["all"], floor * med["plain"], cycle / floor, sum(med[f"{ph} alone"] for ph in PHASES)],
             ["plain flow-matching step", med["plain"], None, None, None],
             ["F (B whole clips, no grad)", med["F"], None, None, None],
             ["stream: each chunk once + writes", med["stream"], (1 + q) * med["F"],
              med["stream"] / ((1 + q) * med["F"]), None]]
    print(format_table(["span", "measured_ms", "minimum_ms", "ratio", "alone_ms"], rows))
    print(f"{'cycle in plain steps':>36}: {cycle:.4g}\n{'analytic minimum in plain steps':>36}: {floor:.4g}")
    ratio = cycle / floor
    print(f"acceptance: Self-Forcing cycle <= 1.1x analytic minimum: {ratio:.3f} -> {'PASS' if ratio <= 1.1 else 'FAIL'}")


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.threads and not torch.cuda.is_available():
        torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix="bench_sf_") as tmp:
        bench = Harness(a, tmp)
        pieces, reps = bench.pieces(), []
        for rep in range(a.warmup + a.repeats):  # round-robin: drifting load hits the cycle and the baselines alike
            t = bench.timed(bench.cycle)
            t.update({name: bench.timed(fn)["all"] for name, fn in pieces.items()})
            reps += [t] if rep >= a.warmup else []
            bench.forwards = bench.forwards if rep >= a.warmup else []
        med = {key: statistics.median(r[key] for r in reps) for key in reps[0]}
        report(a, bench, med)
    return 0


if __name__ == "__main__":
    sys.exit(main())
