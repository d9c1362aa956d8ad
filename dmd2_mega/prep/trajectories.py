"""Teacher ODE trajectories as a shard set (`launch/prepare_trajectories.py`): the data of CausVid / Self-Forcing's
"ODE init", which regresses a few-step (causal) student onto its teacher's deterministic paths.

For row i of --data (i = 0 .. N-1, N = --num-samples) with condition c_i:
    noise_i       = noise_of([i])                    [C, *spatial] float32 (sampling.keyed_noise(--seed, [i], shape):
                                                     one generator per row, so no rank or batch changes it)
    grid          = flow.trajectory_grid(S, sigmas, k): the teacher's Euler grid sigma_grid(S, k), the student grid
                    `sigmas` [N_s] (flow.student_sigmas: --dmd2-denoising-steps / --dmd2-student-sigmas shifted by
                    k = --timestep-shift) and 0, descending, duplicates merged
    x             = flow.euler_path(teacher, noise_i, c_i, null, grid, G): Euler over `grid` from x = noise_i, CFG
                    v = v_neg + G (v_pos - v_neg) over the teacher's null condition (the data's negative prompt)
    trajectory_i  = x at each student sigma          [N_s, C, *spatial] float32 (trajectory_i[0] = noise_i, as
                                                     sigmas[0] = 1)
    latents_i     = x at 0, the teacher's x0         [C, *spatial] float32, not clamped
Output (--out), a shard set that `data.ShardDataset` reads as ordinary data (x0 and conditions) and
`data.trajectories.TrajectoryDataset` as paths: index.json {"shards", "latent_shape", "cond": "embedding",
"cond_shape" | "cond": "labels", "num_classes", "trajectory": {"sigmas", "teacher", "iteration", "guidance",
"teacher_steps", "timestep_shift", "seed", "data"}}; shard_{k:05d}.safetensors with latents [n, C, *spatial],
cond [n, L, D] in the data's dtype (or labels int64 [n]), noise [n, C, *spatial] and trajectory [n, N_s, C, *spatial];
negative.safetensors copied from the data when it has a negative prompt; report.json as prepare_data's (a clip is a
sample).

Shards are writer.py's: shard k holds rows k*S .. k*S + S - 1 (S = --shard-size; rows stand as `Clip(f"{data}[{row}]",
label=row)`), written whole under a temporary name and renamed, with `TrajectoryJob.settings` (everything that changes
the values) in its header. A re-run keeps the shards written with the same settings and redoes the missing ones; a
shard written with other settings is a DataError naming it. Ranks: the teacher runs TP over each TP group, and the
DP groups split the shards (DP rank r does shard k when k % DP == r; the TP ranks of a group run its forwards
together, TP rank 0 writes). Each shard is integrated in batches of --batch-size rows from its first row, so the
values do not depend on the number of ranks. Global rank 0 holds --out's lock (`files.dir_lock`) for the run, then
writes index.json, negative.safetensors and report.json after every shard is done.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from dmd2_mega import flow
from dmd2_mega.data.dataset import parts_record
from dmd2_mega.errors import ConfigError, DataError
from dmd2_mega.files.dir_lock import DirLock

from .clips import Clip
from .writer import (build_report, finished_shards, plan_shards, read_shard_headers, write_index, write_negative,
                     write_report, write_shard)

NoiseFn = Callable[[Sequence[int]], torch.Tensor]
"""rows -> their noise [len(rows), C, *spatial] float32 on the CPU."""


@dataclass(frozen=True)
class TrajectoryJob:
    """The flags of launch/prepare_trajectories.py once resolved against the teacher and the data."""
    teacher: str                # --teacher-load (absolute)
    iteration: int              # the teacher's checkpoint iteration
    data: str                   # --data (absolute when a directory)
    num_samples: int            # rows 0 .. num_samples - 1
    sigmas: tuple               # the student grid, shifted, fp32 values (flow.student_sigmas)
    shift: float                # --timestep-shift
    guidance: float             # --guidance
    teacher_steps: int          # --teacher-steps
    seed: int                   # --seed
    shard_size: int             # --shard-size
    batch_size: int = 16        # --batch-size: rows per forward (does not change the settings)

    def check(self) -> None:
        """ConfigError naming the flag of a value out of range."""
        for flag, v in (("--num-samples", self.num_samples), ("--shard-size", self.shard_size),
                        ("--batch-size", self.batch_size), ("--teacher-steps", self.teacher_steps)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{flag} {v}: expected an integer >= 1")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"--seed {self.seed}: expected an integer >= 0")
        if not (math.isfinite(self.guidance) and self.guidance >= 1):
            raise ConfigError(f"--guidance {self.guidance}: expected a finite number >= 1 (1: no guidance)")
        if not (math.isfinite(self.shift) and self.shift > 0):
            raise ConfigError(f"--timestep-shift {self.shift}: expected a finite number > 0")

    def grid(self) -> tuple:
        """(the Euler grid [floats, ending at 0], the position of each student sigma in it)."""
        return flow.trajectory_grid(self.teacher_steps, torch.tensor(self.sigmas, dtype=torch.float32), self.shift)

    def rows(self) -> List[Clip]:
        """The source rows as writer.py's items, in row order."""
        return [Clip(path=f"{self.data}[{row}]", label=row) for row in range(self.num_samples)]

    def index_entry(self) -> dict:
        """index.json's "trajectory" entry."""
        return {"sigmas": list(self.sigmas), "teacher": self.teacher, "iteration": self.iteration,
                "guidance": self.guidance, "teacher_steps": self.teacher_steps, "timestep_shift": self.shift,
                "seed": self.seed, "data": self.data}

    def settings(self, latent_shape: Sequence[int], cond: dict) -> dict:
        """Everything that changes a shard's values (its header's "settings"; a resume needs them equal)."""
        return {**self.index_entry(), "num_samples": self.num_samples, "shard_size": self.shard_size,
                "latent_shape": list(latent_shape), **cond}


def data_cond(dataset) -> dict:
    """index.json's condition entries of `dataset`: labels and their count, or the embedding shape (and the parts
    of a condition of parts: an image-to-video clip's text and image)."""
    if dataset.num_classes is not None:
        return {"cond": "labels", "num_classes": int(dataset.num_classes)}
    parts = getattr(dataset, "cond_parts", None)
    return {"cond": "embedding", "cond_shape": list(dataset.cond_shape),
            **({"cond_parts": parts_record(parts)} if parts else {})}


@torch.no_grad()
def integrate_rows(model, dataset, rows: Sequence[int], job: TrajectoryJob, noise_of: NoiseFn,
                   device: torch.device) -> dict:
    """The shard tensors of `rows` (module docstring), integrated --batch-size rows at a time from the first."""
    grid, keep = job.grid()
    key = "labels" if dataset.num_classes is not None else "cond"
    parts = {name: [] for name in ("latents", key, "noise", "trajectory")}
    for lo in range(0, len(rows), job.batch_size):
        batch = list(rows[lo:lo + job.batch_size])
        cond = dataset.get_batch(torch.tensor(batch, dtype=torch.int64))[1]
        noise = noise_of(batch).float()
        c = cond.to(device)
        c = c.float() if c.is_floating_point() else c
        null = model.negative_for(c) if job.guidance != 1.0 else None
        x0, states = flow.euler_path(model, noise.to(device), c, null, grid, job.guidance, keep)
        parts["latents"].append(x0.float().cpu())
        parts[key].append(cond)
        parts["noise"].append(noise)
        parts["trajectory"].append(torch.stack(states, dim=1).float().cpu())
    return {name: torch.cat(ts) for name, ts in parts.items()}


def write_trajectories(model, dataset, job: TrajectoryJob, ps, noise_of: NoiseFn, out: str,
                       describe: str = "") -> Optional[dict]:
    """Every rank: the shards of its DP rank that --out lacks (module docstring). `ps`: the ParallelState of
    `init_distributed`; `describe`: the teacher's part of the start-up line. Returns report.json's fields on global
    rank 0, else None."""
    job.check()
    latent_shape, cond = [dataset.channels, *dataset.spatial], data_cond(dataset)
    settings = job.settings(latent_shape, cond)
    chunks = plan_shards(job.rows(), job.shard_size)
    lock = DirLock(out, "--out", DataError) if ps.rank == 0 else None  # before any rank looks at --out
    try:
        if lock is not None and lock.note:
            print(lock.note, flush=True)
        dist.barrier()
        done = finished_shards(out, settings, chunks)  # every rank: a bad shard stops them all with one line
        dist.barrier()  # every look at --out before any write to it
        grid, _ = job.grid()
        if ps.rank == 0:
            null = "" if job.guidance == 1.0 else f" over {dataset.null_note}"
            print(f"prepare_trajectories: {describe}{job.num_samples} rows of --data {job.data} in {len(chunks)} "
                  f"shards of {job.shard_size}, {len(done)} already written; Euler over {len(grid) - 1} steps "
                  f"({job.teacher_steps} teacher steps through the student sigmas "
                  f"{' '.join(f'{s:.4g}' for s in job.sigmas)}), guidance {job.guidance:g}{null}, shift "
                  f"{job.shift:g}, seed {job.seed}; {ps.world_size} rank(s) {ps.layout} on {ps.device}", flush=True)
        model.eval()
        start = time.perf_counter()
        for k in range(ps.dp_rank, len(chunks), ps.dp_size):
            if k in done:
                continue
            t0 = time.perf_counter()
            tensors = integrate_rows(model, dataset, [row for row, _ in chunks[k]], job, noise_of, ps.device)
            if ps.tp_rank == 0:
                write_shard(out, k, tensors, settings, chunks[k], [c.path for _, c in chunks[k]], [])
                print(f"prepare_trajectories: rank {ps.rank} wrote shard {k} ({len(chunks[k])} samples) in "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
        dist.barrier()
        if ps.rank != 0:
            return None
        heads = read_shard_headers(out, len(chunks))
        seconds = time.perf_counter() - start
        write_index(out, heads, latent_shape, {**cond, "trajectory": job.index_entry()})
        if dataset.negative is not None:
            write_negative(out, dataset.negative.float())
        report = build_report(heads, done, seconds, ps.dp_size, {})
        write_report(out, report)
        new = report["clips_this_run"]
        print(f"prepare_trajectories: {report['clips_written']} samples in {len(chunks)} shards at {out} "
              f"({len(done)} kept from an earlier run); {new} samples this run in {seconds:.1f} s "
              f"({new / seconds if seconds > 0 else 0:.2f} samples/s on {ps.dp_size} DP rank(s))", flush=True)
        return report
    finally:
        if lock is not None:
            lock.release()
