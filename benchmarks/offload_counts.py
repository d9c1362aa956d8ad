"""What time-slicing moves per cycle, counted by the offload layer: copies and bytes per role and direction.

    python benchmarks/offload_counts.py [--model-size wan-digits] [--data moving-digits] [--bf16] [--cycles 2]

Runs a DMD2 trainer with --offload-inactive on this machine (a CPU counts the same copies a GPU makes), one warm-up
cycle, then `--cycles` cycles, and prints per role: the copies and bytes of its sleeps (device to host) and wakes
(host to device) per cycle (`offload.Sleeper.counters`), the bytes per trained parameter, and, beside them, what the
previous scheme moved: every storage of the role, one copy each, each way (a frozen role: its weights once, then
host to device only). Those are counted from the same role: its storages as they were before `flatten_parameters`
(one per parameter, buffer, optimizer state tensor and EMA tensor) and their bytes, the zeroed gradients and the
bf16 weights included.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dmd2_mega.arguments import parse_dmd2_args, parse_flow_args  # noqa: E402
from dmd2_mega.methods.dmd2.method import DMD2Trainer  # noqa: E402
from dmd2_mega.teacher_trainer import FlowTrainer  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-size", default="wan-digits")
    p.add_argument("--data", default="moving-digits")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--gan", action="store_true", help="--dmd2-gan: the actor phase reads the critic's weights")
    p.add_argument("--cycles", type=int, default=2)
    return p.parse_args(argv)


def previous_scheme(role) -> tuple[int, int]:
    """(copies, bytes) one sleep of `role` made before this change: a storage per parameter, buffer, fp32 master, Adam
    state tensor and EMA tensor, plus the main_grad buffer, every one copied whole."""
    m, opt = role.model, role.optimizer
    tensors = list(m.parameters()) + list(m.buffers()) + list(role.extra)
    if opt is not None:
        tensors += list(opt.master_params) if opt.mixed else []
        tensors += [v for st in opt.inner.state.values() for v in st.values() if torch.is_tensor(v)]
    grads = [role.grads.buffer] if role.grads is not None else []
    return len(tensors) + len(grads), sum(t.nbytes for t in tensors + grads)


def main(argv=None):
    a = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="offload_counts_") as tmp:
        common = ["--model-size", a.model_size, "--data", a.data, "--micro-batch-size", str(a.micro_batch_size),
                  "--train-iters", "100", "--log-interval", "100"] + ["--bf16"] * a.bf16
        teacher = os.path.join(tmp, "teacher")
        FlowTrainer(parse_flow_args(common + ["--save", teacher])).save()
        tr = DMD2Trainer(parse_dmd2_args(common + ["--teacher-load", teacher, "--offload-inactive",
                                                    "--dmd2-critic-steps-per-rollout", "2"] + ["--dmd2-gan"] * a.gan))
        tr.cycle()
        before = {n: r.sleeper.counters() for n, r in tr.roles.items()}
        for _ in range(a.cycles):
            tr.cycle()
        after = {n: r.sleeper.counters() for n, r in tr.roles.items()}
        for r in tr.roles.values():  # a sleeping role's optimizer state is not read below, but its weights are
            r.sleeper.wake()
        print(f"{a.model_size} on {a.data}, {'bf16' if a.bf16 else 'fp32'}{', GAN head' if a.gan else ''}, "
              f"--offload-inactive: per cycle (mean of {a.cycles} after 1), counted by offload.Sleeper")
        print(f"{'role':>8} | {'sleeps: copies':>14} {'bytes':>12} | {'wakes: copies':>13} {'bytes':>12} | "
              f"{'B/param':>7} | {'previous: copies':>16} {'bytes each way':>14}")
        for name, r in tr.roles.items():
            c = {k: (v - before[name][k]) / a.cycles for k, v in after[name].items()}
            trained = sum(p.numel() for p in r.model.parameters() if p.requires_grad) or \
                sum(p.numel() for p in r.model.parameters())
            copies, nbytes = previous_scheme(r)
            old_d2h = nbytes if r.trainable else 0
            print(f"{name:>8} | {c['d2h_copies']:>14.1f} {c['d2h_bytes']:>12,.0f} | {c['h2d_copies']:>13.1f} "
                  f"{c['h2d_bytes']:>12,.0f} | {c['h2d_bytes'] / trained:>7.2f} | {copies:>16,} "
                  f"{nbytes:>14,}{'' if old_d2h else ' (wakes only)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
