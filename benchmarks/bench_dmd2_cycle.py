"""Benchmark of one DMD2 cycle (DESIGN section 2) and of each of its phases, on one rank.

    python benchmarks/bench_dmd2_cycle.py --model-size digits --micro-batch-size 64 --dmd2-denoising-steps 4 \
        --dmd2-critic-steps-per-rollout 5 [--bf16] [--recompute-granularity full] [--peak-tflops 989] [--csv c.csv]
    # realistic latents on a GPU: --model-size 600m --data synthetic --image-size 32 --in-channels 4 --bf16

No checkpoint needed: the teacher is a random DiT, weights perturbed by N(0, 0.02^2) (adaLN-Zero gates open);
student, critic and the plain-step baseline are copies. `cycle()` is DMD2Trainer.cycle call for call, but M = 1,
no DDP, critic grid 1000 / shift 1 / score range 0.02-0.98, velocity loss, no logs or checkpoints. Overhead
ratio = cycle / (rollout + critic phase + actor step, each run alone); critic steps end at the critic optimizer's
step (a hook). CUDA events, else perf_counter; warm-up, then every variant round-robin --repeats times, medians;
the cycle variants of a repeat share the cycle index (same rollout draws). Memory per phase, offload on / off:
CUDA max_memory_allocated, and the role storage on the device as the offload layer accounts it (all roles'
Sleeper.resident_bytes) at each phase end and before each optimizer step. --bf16: the kernels reject the bf16
DiT's velocity next to fp32 x_s / x0hat in critic_phase / actor_phase (KernelError); a hook returns fp32 here.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import kernels  # noqa: E402
from dmd2_mega import memory_plan as mp  # noqa: E402
from dmd2_mega.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from dmd2_mega.data import GlobalBatchSampler, ImageDataset, build_dataset  # noqa: E402
from dmd2_mega.dmd2 import actor as A, critic as C, roles as R  # noqa: E402
from dmd2_mega.dmd2.rollout import rollout, student_sigmas  # noqa: E402
from dmd2_mega.dmd2.trainer import CRITIC, ROLLOUT  # noqa: E402
from dmd2_mega.offload import Sleeper  # noqa: E402
from dmd2_mega.optim import LRSchedule, build_optimizer  # noqa: E402
from dmd2_mega.parallel import init_distributed, micro_batch_generator as mbg  # noqa: E402
from dmd2_mega.builders import build_model, cast_model, data_info  # noqa: E402

FLAGS = [("--model-size", str, "digits"), ("--micro-batch-size", int, 64), ("--dmd2-denoising-steps", int, 4),
         ("--dmd2-critic-steps-per-rollout", int, 5), ("--dmd2-teacher-guidance-scale", float, 1.0),
         ("--attention-backend", str, "sdpa"), ("--transformer-impl", str, "local"),
         ("--image-size", int, 32), ("--in-channels", int, 4), ("--num-classes", int, 1000),  # --data synthetic
         ("--warmup", int, 2), ("--repeats", int, 5), ("--threads", int, 1), ("--seed", int, 1234),
         ("--peak-tflops", float, None), ("--csv", str, None), ("--bf16", bool, False),
         ("--recompute-granularity", str, None), ("--data", str, "digits")]  # digits | synthetic
CYCLES = {"cycle": ("shared", False), "cycle_original": ("original", False), "cycle_offload": ("shared", True)}
LABELS = {"cycle": "cycle shared, offload off", "cycle_original": "cycle original, offload off",
          "cycle_offload": "cycle shared, offload on", "critic_fwd": "critic fwd (original's extra)",
          "F": "teacher fwd of B = F", "F_KB": "teacher fwd of K*B", "plain": "plain flow-matching step"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    [p.add_argument(f, **({"action": "store_true"} if t is bool else {"type": t, "default": d})) for f, t, d in FLAGS]
    return p.parse_args(argv)


class Bench:
    def __init__(self, a):
        self.a, self.ps = a, init_distributed(ParallelConfig(), a.seed)
        self.dev, self.cuda = self.ps.device, self.ps.device.type == "cuda"
        self.k, self.b, g = a.dmd2_critic_steps_per_rollout, a.micro_batch_size, torch.Generator().manual_seed(a.seed)
        if a.data == "digits":
            self.ds = build_dataset("digits")
        else:
            x = torch.randn(1024 + self.k * self.b, a.in_channels, a.image_size, a.image_size, generator=g).clamp(-1, 1)
            y = torch.randint(0, a.num_classes, x.shape[:1], generator=g)
            self.ds = ImageDataset(x, y, a.num_classes, None, a.data)
        info = data_info(self.ds)
        self.shape = (info["in_channels"], info["image_size"], info["image_size"])
        self.ms = mp.model_shape(a.model_size, info["in_channels"], info["image_size"], num_classes=info["num_classes"])
        mcfg = ModelConfig(size=a.model_size, attention_backend=a.attention_backend,
                           transformer_impl=a.transformer_impl, recompute_granularity=a.recompute_granularity)
        teacher = build_model(mcfg, info, self.ps)
        with torch.no_grad():
            [p.add_(0.02 * torch.randn(p.shape, generator=g).to(p)) for p in teacher.parameters()]
        state, ocfg = teacher.state_dict(), OptimConfig(lr=1e-5, bf16=a.bf16)
        self.roles = {"teacher": R.Role("teacher", cast_model(teacher, a.bf16).requires_grad_(False).eval())}
        for name in ("student", "critic", "plain"):  # plain: the flow-matching baseline step
            model = build_model(mcfg, info, self.ps)
            model.load_state_dict(state)
            model = cast_model(model, a.bf16)
            self.roles[name] = R.Role(name, model, build_optimizer(model, ocfg), LRSchedule(ocfg, 1000))
        self.plain = self.roles.pop("plain")
        [r.model.register_forward_hook(lambda m, i, o: o.float()) for r in self.roles.values() if a.bf16]  # see --bf16
        self.sleepers = {n: Sleeper(n, [r.model], [r.optimizer] if r.optimizer else [], device=self.dev)
                         for n, r in self.roles.items()}
        self.sigmas = student_sigmas(a.dmd2_denoising_steps).to(self.dev)
        self.grid, self.in_range = (t.to(self.dev) for t in C.critic_grid(1000, 1.0, (0.02, 0.98)))
        self.sampler = GlobalBatchSampler(len(self.ds), self.k * self.b, self.k * self.b, 0, 1, a.seed)
        self.it, self.probe, self.on_step, self.stop_counts = 0, None, None, []
        for n in ("student", "critic"):  # before a step grads and optimizer state are alive: the in-phase peak
            self.roles[n].optimizer.inner.register_step_pre_hook(lambda *_: self.probe and self.probe())
        self.roles["critic"].optimizer.inner.register_step_post_hook(lambda *_: self.on_step and self.on_step())

    def set_offload(self, on: bool) -> None:
        for n, r in self.roles.items():
            self.sleepers[n].wake()
            r.sleeper = self.sleepers[n] if on else None

    def do_rollout(self) -> tuple:
        (j, idx), = self.sampler.next_iteration()
        cond = self.ds.get_batch(idx)[1].to(self.dev)
        gen, n = mbg(self.a.seed, self.it, j, self.dev, stream=ROLLOUT), self.k * self.b
        r = rollout(self.roles["student"].model, gen, n, cond, self.sigmas, shape=self.shape, device=self.dev,
                    sample_id_offset=self.it * n, max_batch=self.b if self.dev.type == "cpu" else None)
        self.stop_counts.append(r.stop_step.sum() + len(r))  # sample-forwards (device scalar: no sync)
        return [r], [mbg(self.a.seed, self.it, j, self.dev, stream=CRITIC)]

    def cycle(self, scoring: str, mark=lambda phase: None) -> dict:
        """DMD2Trainer.cycle; mark(phase) starts each phase (timing, memory)."""
        roles = self.roles
        for n in ("student", "critic"):
            roles[n].schedule.apply(roles[n].optimizer, self.it)
        mark("rollout")
        R.enter_phase("rollout", roles)
        self.rollouts, gens = self.do_rollout()
        mark("critic")
        R.enter_phase("critic", roles)
        scores, metrics = self.critic_phase(scoring, gens)
        mark("actor")
        R.enter_phase("actor", roles)
        metrics.update(A.actor_phase(roles["student"], scores))
        self.it += 1
        return metrics

    def critic_phase(self, scoring: str, gens: list):
        return C.critic_phase(self.roles["critic"], self.roles["teacher"], self.rollouts, gens, steps=self.k,
                              micro=self.b, grid=self.grid, in_range=self.in_range, scoring=scoring,
                              loss_space="velocity", guidance=self.a.dmd2_teacher_guidance_scale,
                              null_cond=self.roles["teacher"].model.null_cond)

    def standalone(self) -> dict:
        """Closures fn(mark) of the standalone pieces, each timed alone between two syncs."""
        roles, a, t = self.roles, self.a, self.roles["teacher"]
        gens = lambda: [mbg(a.seed, 0, 0, self.dev, stream=CRITIC)]  # noqa: E731
        self.rollouts = self.do_rollout()[0]
        scores, r0 = self.critic_phase("shared", gens())[0], self.rollouts[0]
        b = r0.micro_batch(self.k - 1, self.b)
        x_s, sigma, _ = C.flow.noise_on_grid(b.x0hat, gens()[0], self.grid[self.in_range])
        x0, cond = (v.to(self.dev) for v in self.ds.get_batch(torch.arange(self.b) % len(self.ds)))
        null, p, no_grad = self.ds.null_cond(self.b).to(self.dev), self.plain, torch.no_grad()

        def plain_step(mark):  # FlowTrainer.train_step with M = 1
            p.schedule.apply(p.optimizer, self.it)
            flow_loss_micro(p.model, x0, cond, null, mbg(a.seed, self.it, 0, self.dev), 1.0, 0.1).backward()
            p.optimizer.step()
            p.optimizer.zero_grad()
        return {"rollout": lambda mark: self.do_rollout(),
                "critic phase": lambda mark: (mark("critic"), self.critic_phase("shared", gens())),
                "critic phase original": lambda mark: self.critic_phase("original", gens()),
                "actor step": lambda mark: A.actor_phase(roles["student"], scores),
                "scoring": lambda mark: C._teacher_score(t, b, x_s, sigma, x_s, null_cond=t.model.null_cond,
                                                                 guidance=a.dmd2_teacher_guidance_scale),
                "critic_fwd": no_grad(
                    lambda mark: kernels.x0_from_velocity(x_s, roles["critic"].model(x_s, sigma, b.cond), sigma)),
                "F": no_grad(lambda mark: t.model(x_s, sigma, b.cond)),
                "F_KB": no_grad(lambda mark: t.model(r0.x, r0.sigma, r0.cond)), "plain": plain_step}

    def timed(self, fn, mem: dict = None) -> dict:
        """{'all', phase, 'critic step k', 'scoring': ms} of one fn(mark); mark(name) starts span `name`. With
        `mem`, {phase: [role bytes, bytes of the phase's own roles, CUDA peak]} collects the phase peaks."""
        st, cur = [], [None]

        def now():
            ev = torch.cuda.Event(enable_timing=True) if self.cuda else None
            return (ev.record(), ev)[1] if ev else time.perf_counter()

        def probe():  # role storage now (phase end, and before each optimizer step: grads alive)
            per, m = {n: s.resident_bytes() for n, s in self.sleepers.items()}, mem[cur[0]]
            m[0], m[1] = max(m[0], sum(per.values())), max(m[1], sum(per[n] for n in R.PHASE_ROLES[cur[0]]))

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
    drawn, nparams = (torch.stack(bench.stop_counts).float().mean().item() / b,
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


def main(argv=None):
    a = parse_args(argv)
    if not torch.cuda.is_available() and a.threads:
        torch.set_num_threads(a.threads)
    bench = Bench(a)
    pieces, reps = bench.standalone(), []
    for rep in range(a.warmup + a.repeats):  # round-robin: drifting load hits every variant alike
        t, it = {}, bench.it
        for v, (scoring, offload) in CYCLES.items():
            bench.it = it  # the same rollout draws in every variant of this repeat
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
