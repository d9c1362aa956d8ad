"""One writer per checkpoint directory: a run holds an exclusive lock on each directory it saves into.

The lock is `fcntl.flock(LOCK_EX | LOCK_NB)` on `<dir>/.dmd2_mega.lock`, taken by global rank 0 before anything
is written and held for the life of the process (the kernel drops it when the process ends, however it ends).
The file records the holder: host, PID and start time, as one JSON line. A second run on the same directory
fails at start-up with one line naming that holder. A lock file whose holder is gone (its flock released by
its death) is taken over, with a message naming the previous holder.

All ranks take part: rank 0 locks, then one collective tells every rank whether it could, so that all
of them stop together (no rank waits forever at a barrier). flock is reliable on local file systems;
on NFS it depends on the server (Linux NFSv4 maps it to POSIX locks).
A process may build several trainers on one directory (the tests do); a lock it holds already is reused.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from typing import Optional, Sequence

from dmd2_mega.errors import CheckpointError
from dmd2_mega.logger import print_rank0
from dmd2_mega.parallel import ParallelState, any_rank

LOCK_NAME = ".dmd2_mega.lock"
_HELD: dict = {}  # realpath of a locked directory -> the open fd that holds its flock


def _holder(fd: int) -> dict:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        return json.loads(text) if text else {}
    except (OSError, ValueError):
        return {}


def _describe(h: dict) -> str:
    if not h:
        return "holder unknown"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.get("start", 0)))
    return f"host {h.get('host')}, pid {h.get('pid')}, started {started}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def acquire(directory: str, flag: str) -> Optional[str]:
    """Lock `directory` (created if missing) for this process; returns a message when a stale lock file was
    taken over. Raises CheckpointError naming the holder when another live process holds it."""
    key = os.path.realpath(directory)
    if key in _HELD:
        return None
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise CheckpointError(f"{flag} {directory} is in use by another run ({_describe(holder)}; lock file {path}): "
                              f"two runs must not write one directory; wait for it to end or choose another "
                              f"{flag.split()[0]}") from None
    previous = _holder(fd)
    note = None
    if previous and previous.get("pid") != os.getpid():
        same_host = previous.get("host") == socket.gethostname()
        gone = "no longer running" if same_host and not _alive(int(previous.get("pid", 0))) else "lock released"
        note = f"> took over the lock of {directory} left by {_describe(previous)} ({gone})"
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "start": time.time()}) + "\n")
              .encode(), 0)
    _HELD[key] = fd
    return note


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
