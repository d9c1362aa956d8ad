"""Benchmark of one DMD2 cycle (DESIGN section 2) and of each of its phases, on one rank.

    python benchmarks/bench_dmd2_cycle.py --model-size digits --micro-batch-size 64 --dmd2-denoising-steps 4 \
        --dmd2-critic-steps-per-rollout 5 [--bf16] [--recompute-granularity full] [--peak-tflops 989] [--csv c.csv]
    # any family, any data the trainers read: --model-size wan-digits --data moving-digits
    # realistic latents on a GPU: --model-size 600m --data synthetic --image-size 32 --in-channels 4 --bf16
    #                             --model-size wan2.1-1.3b --data synthetic --latent-shape 16 5 60 104 --bf16

What is timed is the product's own code, through the family contract only (nothing here names a family): the
teacher trainer (`teacher_trainer.FlowTrainer`) builds a random `--model-size` model on `--data`, perturbs its
weights by N(0, 0.02^2) (adaLN-Zero gates open) and saves it as the teacher checkpoint; the DMD2 trainer
(`methods.trainer.StudentTrainer` running the --distill-method, DMD2 here; M = 1, no DDP) loads it into its three
roles, and a cycle is `methods.dmd2.cycle.run_cycle` on the trainer's roles, micro-batch records and settings
(what `DMD2Trainer.cycle` runs), its phases timed through the cycle's hook. Critic grid, shift and score range are the trainer's defaults.
The standalone pieces are the same steps (`methods.dmd2.cycle.steps`, run alone by `benchmarks.pieces.Pieces` on the
micro-batch records and inputs they have inside a cycle: the same draws), the scoring piece the critic phase's own
`score_kept`, and the plain flow-matching baseline is `FlowTrainer.train_step`.
`--data` is passed to both trainers (digits, moving-digits, a shard directory); `--data synthetic` writes random
latents as a shard directory in a temp dir (`data.write_shards`) in the shape and condition kind the family takes
for the planner's flags (`ModelFamily.plan_data`: `--latent-shape` or `--in-channels` x `--image-size`; labels of
`--num-classes`, or embeddings of `--cond-shape` / `--text-len`).
Overhead ratio = cycle / (rollout + critic phase + actor step, each run alone); critic steps end at the critic
optimizer's step (a hook). CUDA events, else perf_counter; warm-up, then every variant round-robin --repeats times,
medians; the cycle variants of a repeat share the cycle index (same data and rollout draws). Memory per phase,
offload on / off: CUDA max_memory_allocated, and the role storage on the device as the offload layer accounts it
(all roles' Sleeper.resident_bytes) at each phase end and before each optimizer step.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import dmd2_kernels  # noqa: E402
from benchmarks.pieces import Pieces  # noqa: E402
from dmd2_mega.plan import memory_plan as mp  # noqa: E402
from dmd2_mega.arguments import parse_dmd2_args, parse_flow_args  # noqa: E402
from dmd2_mega.data import write_shards  # noqa: E402
from dmd2_mega.methods.base import phase_needs  # noqa: E402
from dmd2_mega.methods.dmd2.critic import critic_steps, score_kept  # noqa: E402
from dmd2_mega.methods.dmd2.cycle import run_cycle, steps  # noqa: E402
from dmd2_mega.methods.dmd2.method import DMD2Method  # noqa: E402
from dmd2_mega.methods.self_forcing.method import SelfForcingMethod  # noqa: E402
from dmd2_mega.methods.trainer import StudentTrainer  # noqa: E402
from dmd2_mega.models import get_size  # noqa: E402
from dmd2_mega.teacher_trainer import FlowTrainer  # noqa: E402

FLAGS = [("--model-size", str, "digits"), ("--micro-batch-size", int, 64), ("--dmd2-denoising-steps", int, 4),
         ("--dmd2-critic-steps-per-rollout", int, 5), ("--dmd2-teacher-guidance-scale", float, 1.0),
         ("--attention-backend", str, "sdpa"), ("--transformer-impl", str, "local"),
         ("--image-size", int, 32), ("--in-channels", int, 4), ("--num-classes", int, 1000),  # --data synthetic
         ("--latent-shape", int, None), ("--cond-shape", int, None), ("--text-len", int, None),  # --data synthetic
         ("--warmup", int, 2), ("--repeats", int, 5), ("--threads", int, 1), ("--seed", int, 1234),
         ("--peak-tflops", float, None), ("--csv", str, None), ("--bf16", bool, False),
         ("--recompute-granularity", str, None), ("--data", str, "digits")]  # digits | moving-digits | DIR | synthetic
LISTS = ("--latent-shape", "--cond-shape")
CYCLES = {"cycle": ("shared", False), "cycle_original": ("original", False), "cycle_offload": ("shared", True)}
LABELS = {"cycle": "cycle shared, offload off", "cycle_original": "cycle original, offload off",
          "cycle_offload": "cycle shared, offload on", "critic_fwd": "critic fwd (original's extra)",
          "F": "teacher fwd of B = F", "F_KB": "teacher fwd of K*B", "plain": "plain flow-matching step"}


def add_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`FLAGS` on `p` (benchmarks/bench_gan_cycle.py takes them too)."""
    [p.add_argument(f, **({"action": "store_true"} if t is bool else {"type": t, "default": d})
                    | ({"nargs": "+"} if f in LISTS else {})) for f, t, d in FLAGS]
    return p


def parse_args(argv=None):
    return add_flags(argparse.ArgumentParser(description=__doc__.split("\n")[0])).parse_args(argv)


def synthetic_shards(a, root: str, n: int) -> str:
    """n random samples in the shape and condition kind --model-size's family takes for these flags."""
    size = get_size(a.model_size)
    shape = size.family.plan_data(size.spec, a.model_size, latent_shape=a.latent_shape, in_channels=a.in_channels,
                                  image_size=a.image_size, num_classes=a.num_classes, cond_shape=a.cond_shape,
                                  text_len=a.text_len)
    g = torch.Generator().manual_seed(a.seed)
    x = torch.randn(n, *shape.sample_shape, generator=g).clamp(-1, 1)
    cond = ({"labels": torch.randint(0, shape.num_classes, (n,), generator=g), "num_classes": shape.num_classes}
            if shape.cond_shape is None else {"cond": torch.randn(n, *shape.cond_shape, generator=g)})
    write_shards(os.path.join(root, "data"), x, **cond)
    return os.path.join(root, "data")


METHODS = {"dmd2": DMD2Method, "self-forcing": SelfForcingMethod}
"""--distill-method -> the method (as launch/pretrain_dmd2.py maps it): count_launches' --extra may ask for either."""


def trainer(cfg) -> StudentTrainer:
    return StudentTrainer(cfg, METHODS[cfg.dmd2.distill_method])


class Harness:
    def __init__(self, a, tmp: str, extra: tuple = (), shared: tuple = ()):
        """`extra`: further pretrain_dmd2.py flags of the DMD2 trainer (benchmarks/bench_gan_cycle.py: the GAN head);
        `shared`: flags of both trainers, the plain-step baseline's too (benchmarks/count_launches.py: --compile)."""
        self.a = a
        self.k, self.b = a.dmd2_critic_steps_per_rollout, a.micro_batch_size
        data = synthetic_shards(a, tmp, 1024 + self.k * self.b) if a.data == "synthetic" else a.data
        common = ["--model-size", a.model_size, "--attention-backend", a.attention_backend, "--transformer-impl",
                  a.transformer_impl, "--micro-batch-size", str(self.b), "--data", data, "--seed", str(a.seed),
                  "--lr", "1e-5", "--train-iters", "1000", "--log-interval", "1000", *shared]
        common += ["--bf16"] * a.bf16 + (["--recompute-granularity", a.recompute_granularity]
                                         if a.recompute_granularity else [])
        teacher = os.path.join(tmp, "teacher")
        self.plain = FlowTrainer(parse_flow_args(common + ["--save", teacher]))  # also the plain-step baseline
        g = torch.Generator().manual_seed(a.seed)
        with torch.no_grad():
            [p.add_(0.02 * torch.randn(p.shape, generator=g).to(p)) for p in self.plain.model.parameters()]
        self.plain.save()
        self.tr = trainer(parse_dmd2_args(common + [
            "--teacher-load", teacher, "--no-offload-inactive", "--dmd2-denoising-steps", str(a.dmd2_denoising_steps),
            "--dmd2-critic-steps-per-rollout", str(self.k),
            "--dmd2-teacher-guidance-scale", str(a.dmd2_teacher_guidance_scale), *extra]))
        self.ps, self.dev = self.tr.ps, self.tr.ps.device
        self.cuda = self.dev.type == "cuda"
        self.shape = self.tr.shape
        self.ms = mp.model_shape_from_info(a.model_size, self.tr.info)
        self.roles = {False: self.tr.roles, True: {n: r.with_offload(self.dev, self.tr.method.phases)
                                                for n, r in self.tr.roles.items()}}
        self.sleepers = {n: r.sleeper for n, r in self.roles[True].items()}
        self.probe, self.on_step, self.forwards = None, None, []
        for n in ("student", "critic"):  # before a step grads and optimizer state are alive: the in-phase peak
            self.tr.roles[n].optimizer.inner.register_step_pre_hook(lambda *_: self.probe and self.probe())
        self.tr.roles["critic"].optimizer.inner.register_step_post_hook(lambda *_: self.on_step and self.on_step())

    def at(self, it: int) -> None:
        """Put the trainer at cycle `it` (data position included): the same draws for every variant."""
        self.tr.state = replace(self.tr.state, iteration=it)
        self.tr.sampler.consumed_samples = it * self.tr.sampler.global_batch_size

    def set_offload(self, on: bool) -> None:
        for s in self.sleepers.values():
            s.wake()
        self.tr.roles = self.roles[on]

    def cycle(self, scoring: str, mark=lambda phase: None) -> dict:
        """`run_cycle` on the trainer's roles, micro-batch records and settings (--dmd2-critic-scoring
        `scoring`), at this cycle's learning rates; mark(phase) starts each phase."""
        tr = self.tr
        for name in ("student", "critic"):
            tr.roles[name].schedule.apply(tr.roles[name].optimizer, tr.iteration)
        result = run_cycle(tr.roles, tr.micro_batches(), replace(tr.method.settings, scoring=scoring), hook=mark)
        tr.state = replace(tr.state, iteration=tr.iteration + 1)
        self.forwards.append(result.rollout_forwards)  # device scalar: no sync
        return result.metrics

    def standalone(self) -> dict:
        """Closures fn(mark) of the standalone pieces, each timed alone between two syncs: the method's own steps
        (`pieces.Pieces`: each on the micro-batch records and input it has inside a cycle) and the baselines."""
        tr, st = self.tr, self.tr.method.settings
        roles, t = tr.roles, tr.roles["teacher"]
        self.at(0)
        pieces = Pieces(steps(st), roles, tr.micro_batches())
        original = steps(replace(st, scoring="original"))[1]  # the critic step under --dmd2-critic-scoring original
        rollouts = pieces.handed["rollout"]
        kept = critic_steps(roles["critic"], rollouts, pieces.records("critic"), st)[0]  # what the teacher scores
        b, x_s, sigma, _ = kept[0]
        r0 = rollouts[0]
        no_grad = torch.no_grad()
        return {"rollout": lambda mark: pieces.run("rollout"),
                "critic phase": lambda mark: (mark("critic"), pieces.run("critic")),
                "critic phase original": lambda mark: pieces.run("critic", original),
                "actor step": lambda mark: pieces.run("actor"),
                "scoring": lambda mark: score_kept(t, kept, st),
                "critic_fwd": no_grad(
                    lambda mark: dmd2_kernels.x0_from_velocity(
                        x_s, roles["critic"].model(x_s, sigma, b.cond).to(x_s.dtype),
                                                          sigma)),
                "F": no_grad(lambda mark: t.model(x_s, sigma, b.cond)),
                "F_KB": no_grad(lambda mark: t.model(r0.x, r0.sigma, r0.cond)),
                "plain": lambda mark: self.plain.train_step()}

    def timed(self, fn, mem: dict = None) -> dict:
        """{'all', phase, 'critic step k', 'scoring': ms} of one fn(mark); mark(name) starts span `name`. With
        `mem`, {phase: [role bytes, bytes of the phase's own roles, CUDA peak]} collects the phase peaks."""
        st, cur = [], [None]

        def now():
            ev = torch.cuda.Event(enable_timing=True) if self.cuda else None
            return (ev.record(), ev)[1] if ev else time.perf_counter()

        def probe():  # role storage now (phase end, and before each optimizer step: grads alive)
            per, m = {n: s.resident_bytes() for n, s in self.sleepers.items()}, mem[cur[0]]
            m[0], m[1] = max(m[0], sum(per.values())), max(m[1], sum(per[n] for n in phase_needs(self.tr.method.phases, cur[0])))

        def mark(name):
            if mem is not None:
                self.sync()
                if cur[0] in mem:
                    probe()
                    mem[cur[0]][2] = torch.cuda.max_memory_allocated(self.dev) if self.cuda else 0
                cur[0] = self.cuda and torch.cuda.reset_peak_memory_stats(self.dev) or name
            st.append((name, now()))
        self.on_step, self.probe = (lambda: st.append(("step", now()))), (probe if mem is not None else None)
        self.sync()
        (st.append(("all", now())), fn(mark), mark("end"))
        self.sync()
        self.on_step = self.probe = None
        el = (lambda s, e: s.elapsed_time(e)) if self.cuda else (lambda s, e: (e - s) * 1e3)  # noqa: E731
        marks, steps = [m for m in st if m[0] != "step"], [m[1] for m in st if m[0] == "step"]
        out = {n: el(s, e) for (n, s), (_, e) in zip(marks[:-1], marks[1:])}
        out["all"] = el(st[0][1], st[-1][1])
        if "critic" in out:
            i = [m[0] for m in marks].index("critic")
            edges = [marks[i][1]] + steps + [marks[i + 1][1]]
            out.update({f"critic step {k}": el(s, e) for k, (s, e) in enumerate(zip(edges[:-2], edges[1:-1]))})
            out["scoring"] = el(edges[-2], edges[-1])
        return out

    def sync(self):
        self.cuda and torch.cuda.synchronize(self.dev)

    def count_syncs(self) -> int:
        """Host syncs in one cycle (CUDA: torch.cuda sync debug mode warns at each)."""
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            (self.cycle("shared"), self.sync())
        torch.cuda.set_sync_debug_mode(0)
        return sum("synchroniz" in str(w.message) for w in caught)


def peak_tflops(bench, n: int = 8192, reps: int = 20) -> float:
    """A bf16 n x n matmul's TFLOP/s: the MFU denominator when --peak-tflops is not given."""
    x = torch.randn(n, n, device=bench.dev, dtype=torch.bfloat16)
    ms = [bench.timed(lambda mark: [x @ x for _ in range(reps)])["all"] for _ in range(2)][-1]  # the 1st warms up
    return reps * 2 * n ** 3 / (ms * 1e-3) / 1e12


def report(a, bench, med, mem, syncs, peak):
    k, b, cuda, rec = bench.k, bench.b, bench.cuda, a.recompute_granularity == "full"
    sh, orig = (mp.cycle_passes(k, a.dmd2_denoising_steps, a.dmd2_teacher_guidance_scale, s, rec)
                for s in ("shared", "original"))
    dev = torch.cuda.get_device_name(bench.dev) if cuda else \
        f"CPU ({torch.get_num_threads()} torch threads, {os.cpu_count()} cores, load avg {os.getloadavg()[0]:.1f})"
    drawn, nparams = (torch.stack(bench.forwards).float().mean().item() / b,
                      sum(p.numel() for p in bench.plain.model.parameters()))
    print(f"device: {dev} | torch {torch.__version__} | {a.model_size} ({nparams / 1e6:.2f} M params/role) | "
          f"{a.data} {'x'.join(map(str, bench.shape))} | B={b} K={k} N={a.dmd2_denoising_steps} g="
          f"{a.dmd2_teacher_guidance_scale} | {'bf16' if a.bf16 else 'fp32'} | recompute "
          f"{a.recompute_granularity or 'none'} | median of {a.repeats}\n{mp.describe_passes(sh, drawn)}\n(in_cycle: "
          "spans inside the cycle; cycle rows: their critic phase; critic steps standalone: in a critic phase alone)")
    steps = [f"critic step {i}" for i in range(k)]
    passes = [sh["rollout"]] + [sh["critic"] / k] * k + [sh["scoring"], sh["actor"]]
    alone = ["rollout"] + ["sa_" + x for x in steps] + ["scoring", "actor step"]  # standalone keys
    rows = [[x, med[y], med[f"in_{x}"], p] for x, y, p in zip(["rollout", *steps, "scoring", "actor"], alone, passes)]
    med["phases"] = med["rollout"] + med["critic phase"] + med["actor step"]
    rows += [["critic phase (steps + scoring)", med["critic phase"], med["in_critic"], sh["critic"] + sh["scoring"]],
             ["sum of phases", med["phases"], sum(med[f"in_{p}"] for p in mp.PHASES), sh["cycle"]]]
    rows += [[LABELS[x], med[x], med.get(f"{x} critic"), p] for x, p in zip(
        LABELS, [sh["cycle"], orig["cycle"], sh["cycle"], 1, 1, k, sh["plain_step"]])]
    print(mp.format_table(["phase", "standalone_ms", "in_cycle_ms", "passes_F", "measured_F"],
                          [r + [r[1] / med["F"]] for r in rows]))
    summary = mp.cycle_summary(med, sh, k=k, b=b, drawn=drawn, flops_per_sample=mp.forward_flops(bench.ms, 1),
                               peak_tflops=peak)
    summary.update({"host syncs per cycle (CUDA sync debug)": syncs} if syncs is not None else {})
    print("\n".join(f"{key:>46}: {v:.4g}" for key, v in summary.items()))
    mrows = [[p, mem[False][p][0] / 2**20, mem[True][p][0] / 2**20, mem[True][p][1] / 2**20]
             + ([mem[False][p][2] / 2**20, mem[True][p][2] / 2**20] if cuda else []) for p in mp.PHASES]
    print("memory per phase (MiB, phase peak): role storage on the compute device as the offload layer accounts it, "
          "offload off / on; needed_roles: the phase's own roles" + ("; CUDA max_memory_allocated" if cuda else ""))
    print(mp.format_table(["phase", "roles_off", "roles_on", "needed_roles"] + ["cuda_off", "cuda_on"] * cuda, mrows))
    persistent = sum(s.resident_bytes() for s in bench.sleepers.values()) / 2**20  # all roles, grads freed
    for what, v, ok in mp.acceptance(summary, mrows, persistent):
        print(f"acceptance: {what}: {v:.3f} -> {'PASS' if ok else 'FAIL'}")
    if a.csv:
        mcols = ["roles_off", "roles_on", "needed_roles", "cuda_off", "cuda_on"]
        with open(a.csv, "w", newline="") as f:
            csv.writer(f).writerows(
                [["device", "section", "name", "value"]] + [[dev, "time_ms", *r[:2]] for r in rows]
                + [[dev, "summary", *kv] for kv in summary.items()]
                + [[dev, "memory_MiB", f"{r[0]} {c}", v] for r in mrows for c, v in zip(mcols, r[1:])])
        print(f"wrote {a.csv}")


def harnessed(a, run: Callable, prefix: str) -> None:
    """run(a, a Harness of `a`'s flags) in a scratch folder, the CPU's threads set (benchmarks/bench_cuda_graphs.py
    runs its own `run` this way)."""
    if not torch.cuda.is_available() and a.threads:
        torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        run(a, Harness(a, tmp))


def main(argv=None):
    harnessed(parse_args(argv), run, "bench_dmd2_")


def run(a, bench: Harness) -> None:
    pieces, reps = bench.standalone(), []
    for rep in range(a.warmup + a.repeats):  # round-robin: drifting load hits every variant alike
        t, it = {}, rep
        for v, (scoring, offload) in CYCLES.items():
            bench.at(it)  # the same data and rollout draws in every variant of this repeat
            bench.set_offload(offload)
            spans = bench.timed(lambda mark: bench.cycle(scoring, mark))
            bench.set_offload(False)
            t[v], t[f"{v} critic"] = spans["all"], spans["critic"]
            t.update({f"in_{x}": ms for x, ms in spans.items()} if v == "cycle" else {})
        for name, fn in pieces.items():
            spans = bench.timed(fn)
            t[name] = spans.pop("all")
            t.update({f"sa_{x}": ms for x, ms in spans.items()} if name == "critic phase" else {})
        t["gap"] = (t["cycle_original critic"] - t["in_critic"] + t["critic phase original"] - t["critic phase"]) / 2
        reps += [t] if rep >= a.warmup else []
    med = {key: statistics.median(r[key] for r in reps) for key in reps[0]}
    mem = {o: {p: [0, 0, 0] for p in mp.PHASES} for o in (False, True)}
    for o in mem:  # one 'shared' cycle each, offload off and on
        bench.set_offload(o)
        bench.timed(lambda mark: bench.cycle("shared", mark), mem[o])
        bench.set_offload(False)
    report(a, bench, med, mem, bench.count_syncs() if bench.cuda else None,
           a.peak_tflops or (peak_tflops(bench) if bench.cuda else None))


if __name__ == "__main__":
    main()
