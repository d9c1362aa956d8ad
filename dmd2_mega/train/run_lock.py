"""One writer per checkpoint directory: the trainers lock each directory they save into (`dir_lock`).

Global rank 0 takes the flock (`dir_lock.acquire`) before anything is written, then one collective tells every
rank whether it could, so that all of them stop together (no rank waits forever at a barrier).
"""
from __future__ import annotations

from typing import Sequence

from dmd2_mega.files.dir_lock import acquire
from dmd2_mega.errors import CheckpointError
from dmd2_mega.train.logger import print_rank0
from dmd2_mega.distributed.parallel import ParallelState, any_rank


def lock_run_dirs(dirs: Sequence[tuple[str, str]], ps: ParallelState) -> None:
    """Collective: rank 0 locks each (flag, directory); every rank raises if it could not."""
    error = None
    if ps.rank == 0:
        try:
            for flag, directory in dirs:
                note = acquire(directory, flag)
                if note:
                    print_rank0(note, ps.rank)
        except (CheckpointError, OSError) as e:
            error = e
    if any_rank(error is not None, ps.device):
        if error is None:
            raise CheckpointError(f"rank 0 could not lock {', '.join(d for _, d in dirs)} (see its message)")
        if isinstance(error, OSError):
            raise CheckpointError(f"cannot create the lock file in {dirs[0][1]}: {error}") from error
        raise error
