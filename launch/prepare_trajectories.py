#!/usr/bin/env python
"""Sample a teacher's ODE trajectories for the conditions of --data: the shard set a causal student's ODE init reads.

    python launch/prepare_trajectories.py --teacher-load runs/teacher --data moving-digits --num-samples 4096 \
        --out runs/trajectories                     # Euler 50 steps through the 4-step student grid, CFG 1.25
    torchrun --nproc-per-node 8 launch/prepare_trajectories.py --teacher-load /ckpt/wan_teacher \
        --data /data/wan_480p --out /data/wan_480p_ode --tensor-model-parallel-size 2 --batch-size 4

For rows 0 .. N-1 of --data (N = --num-samples, default all), the teacher (a Megatron-layout checkpoint) integrates
dx/dsigma = v with Euler steps and CFG --guidance over the data's negative prompt (or the null class) from the
row's own noise (--seed and the row index) over the union of its --teacher-steps grid and the student grid
(--dmd2-denoising-steps N or --dmd2-student-sigmas s1 s2 ..., shifted by --timestep-shift, default the teacher's);
each shard stores the noise, x at each student sigma (`trajectory`), the final x0 (`latents`) and the conditions.
Format and ranks: dmd2_mega/prep/trajectories.py; docs/prepare_data.md. `--data DIR` of the result trains like any
shard set. A re-run with the same flags keeps finished shards and does the rest; a shard written with other flags is
an error naming it. A bad flag, a teacher that does not fit --data, a busy --out: exit 1 with one line
`<ErrorType>: <message>` on stderr.
"""
import argparse
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dmd2_mega import flow  # noqa: E402
from dmd2_mega.config import ParallelConfig, TrainConfig  # noqa: E402
from dmd2_mega.data import build_dataset  # noqa: E402
from dmd2_mega.distributed.parallel import destroy_distributed, init_distributed  # noqa: E402
from dmd2_mega.errors import CheckpointError, ConfigError, DataError  # noqa: E402
from dmd2_mega.files.path_guard import check_outputs_apart  # noqa: E402
from dmd2_mega.models import DataShape  # noqa: E402
from dmd2_mega.prep.trajectories import TrajectoryJob, write_trajectories  # noqa: E402
from dmd2_mega.sampling import check_out_dir, keyed_noise, load_sampling_model  # noqa: E402
from dmd2_mega.train.builders import data_info  # noqa: E402
from dmd2_mega.train.checkpoint import latest_iteration, load_payload  # noqa: E402
from dmd2_mega.train.resilience import run_main  # noqa: E402

DEFAULT_STUDENT_STEPS, DEFAULT_TEACHER_STEPS = 4, 50


def parse(argv=None) -> argparse.Namespace:
    g = TrainConfig.eval_guidance
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher-load", metavar="DIR", help="the teacher checkpoint (Megatron layout); required")
    p.add_argument("--data", help="whose conditions to sample: digits, moving-digits[:T] or a shard directory; "
                                  "required")
    p.add_argument("--out", metavar="DIR", help="the trajectory shard directory to write; required")
    p.add_argument("--num-samples", type=int, default=None, help="rows 0 .. N-1 of --data (default: all)")
    p.add_argument("--teacher-steps", type=int, default=DEFAULT_TEACHER_STEPS,
                   help=f"the teacher's Euler grid (default {DEFAULT_TEACHER_STEPS}), merged with the student's")
    p.add_argument("--dmd2-denoising-steps", type=int, default=None,
                   help=f"the student grid's size (default {DEFAULT_STUDENT_STEPS}), as the DMD2 trainer's")
    p.add_argument("--dmd2-student-sigmas", type=float, nargs="+", default=None, metavar="S",
                   help="explicit UNSHIFTED student sigmas, from 1.0 down (wins over --dmd2-denoising-steps)")
    p.add_argument("--timestep-shift", type=float, default=None, help="default: the teacher's --timestep-shift")
    p.add_argument("--guidance", type=float, default=g,
                   help=f"CFG scale over the data's negative prompt (default {g:g}, the trainers' --eval-guidance)")
    p.add_argument("--seed", type=int, default=0, help="noise of row i: its own generator seeded by (seed, i)")
    p.add_argument("--shard-size", type=int, default=64, help="samples per shard (default 64)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per forward (default 16)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    a = p.parse_args(argv)
    for flag, v, what in (("--teacher-load", a.teacher_load, "the teacher checkpoint directory"),
                          ("--data", a.data, "the data whose conditions are sampled"),
                          ("--out", a.out, "the trajectory shard directory to write")):
        if not v:
            raise ConfigError(f"{flag} is required ({what})")
    for flag, v in (("--num-samples", a.num_samples), ("--dmd2-denoising-steps", a.dmd2_denoising_steps)):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} {v}: expected an integer >= 1")
    if a.tensor_model_parallel_size < 1:
        raise ConfigError(f"--tensor-model-parallel-size {a.tensor_model_parallel_size}: expected an integer >= 1")
    explicit = a.dmd2_student_sigmas
    if explicit is not None and a.dmd2_denoising_steps not in (None, len(explicit)):
        raise ConfigError(f"--dmd2-denoising-steps {a.dmd2_denoising_steps} disagrees with --dmd2-student-sigmas "
                          f"{' '.join(f'{v:g}' for v in explicit)} ({len(explicit)} values); give one of the two")
    job(a, 0, 1.0 if a.timestep_shift is None else a.timestep_shift, a.num_samples or 1)  # before any model loads
    check_out_dir(a.out, "--out", "the trajectory shards")
    check_outputs_apart([("--out", a.out)], [("--teacher-load", a.teacher_load), ("--data", a.data)])
    return a


def job(a: argparse.Namespace, iteration: int, shift: float, num_samples: int) -> TrajectoryJob:
    """The checked job of the flags (ConfigError / GridError naming a flag out of range)."""
    data = os.path.abspath(a.data) if os.path.isdir(a.data) else a.data
    todo = TrajectoryJob(teacher=os.path.abspath(a.teacher_load), iteration=iteration, data=data,
                         num_samples=num_samples, sigmas=(), shift=float(shift), guidance=float(a.guidance),
                         teacher_steps=a.teacher_steps, seed=a.seed, shard_size=a.shard_size, batch_size=a.batch_size)
    todo.check()
    sigmas = flow.student_sigmas(a.dmd2_denoising_steps or DEFAULT_STUDENT_STEPS, a.dmd2_student_sigmas, shift)
    return replace(todo, sigmas=tuple(sigmas.tolist()))


def check_teacher(info: dict, dataset, a: argparse.Namespace) -> None:
    """DataError naming --data and --teacher-load unless the teacher was trained on data of --data's shape."""
    want, got = DataShape.from_info(info), DataShape.from_info(data_info(dataset))
    if want != got:
        def says(s):
            cond = (f"labels of {s.num_classes} classes" if s.num_classes is not None else
                    f"embeddings {list(s.cond_shape)}")
            return f"samples {list(s.sample_shape)} with {cond}"
        raise DataError(f"--data {a.data} holds {says(got)}, but --teacher-load {a.teacher_load} was trained on "
                        f"{says(want)}; give the data the teacher was trained on")


def prepare(a: argparse.Namespace) -> None:
    if latest_iteration(a.teacher_load, "--teacher-load") is None:
        raise CheckpointError(f"--teacher-load {a.teacher_load} holds no checkpoint (no "
                              f"latest_checkpointed_iteration.txt)")
    dataset = build_dataset(a.data)
    n = a.num_samples or len(dataset)
    if n > len(dataset):
        raise ConfigError(f"--num-samples {n}: --data {a.data} has only {len(dataset)} rows")
    ps = init_distributed(ParallelConfig(a.tensor_model_parallel_size), seed=a.seed)
    payload = load_payload(a.teacher_load, ps, flag="--teacher-load")
    if "student_sigmas" in payload:
        raise ConfigError(f"--teacher-load {a.teacher_load} is a DMD2 student (its checkpoint holds a student grid); "
                          f"give the flow-matching teacher it was distilled from")
    info = payload["data_info"]
    if info is not None:
        check_teacher(info, dataset, a)
    info = info or data_info(dataset)  # a teacher converted from diffusers records no data
    saved_shift = (payload["args"].get("train") or {}).get("timestep_shift", 1.0)
    shift = a.timestep_shift if a.timestep_shift is not None else saved_shift
    todo = job(a, int(payload["iteration"]), shift, n)
    model, weights = load_sampling_model(payload, info, ps, source=f"--teacher-load {a.teacher_load}",
                                         negative=dataset.negative)
    shape = tuple(DataShape.from_info(info).sample_shape)
    where = "given" if a.timestep_shift is not None else "the teacher's"
    describe = (f"teacher {todo.teacher} iteration {todo.iteration} ({weights}, shift {shift:g}: {where}); ")
    write_trajectories(model, dataset, todo, ps, lambda rows: keyed_noise(a.seed, rows, shape)[0], a.out, describe)


def main(argv=None) -> int:
    """0 after writing the shards; 1 with a one-line `<ErrorType>: <message>` for a bad flag, checkpoint or data."""
    return run_main(lambda: prepare(parse(argv)), destroy_distributed)


if __name__ == "__main__":
    sys.exit(main())
