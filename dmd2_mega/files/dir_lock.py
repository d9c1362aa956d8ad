"""One writer per directory: an exclusive lock that a run holds on each directory it writes into.

The lock is `fcntl.flock(LOCK_EX | LOCK_NB)` on `<dir>/.dmd2_mega.lock`, taken before anything is written and
held for the life of the process (the kernel drops it when the process ends, however it ends), or until a
`DirLock` is released. The file records the holder: host, PID and start time, as one JSON line. A second run
on the same directory fails at start-up with one line naming that holder. A lock file whose holder is gone
(its flock released by its death) is taken over, with a message naming the previous holder. flock is
reliable on local file systems; on NFS it depends on the server (Linux NFSv4 maps it to POSIX locks).
A process may build several trainers on one directory (the tests do); a lock it holds already is reused.
The trainers take it through `run_lock.lock_run_dirs` (a collective), `launch/prepare_data.py` on rank 0 for
--out; this module imports nothing of the training stack.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from typing import Optional, Type

from dmd2_mega.errors import CheckpointError

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


def acquire(directory: str, flag: str, error: Type[Exception] = CheckpointError) -> Optional[str]:
    """Lock `directory` (created if missing) for this process; returns a message when a stale lock file was
    taken over. Raises `error` (CheckpointError: a trainer's --save) naming the holder when another live
    process holds it."""
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
        raise error(f"{flag} {directory} is in use by another run ({_describe(holder)}; lock file {path}): "
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


class DirLock:
    """`acquire` for one job of this process (prepare_data's --out): `release()` unlocks it, unless the process
    held the lock already when it was made."""

    def __init__(self, directory: str, flag: str, error: Type[Exception] = CheckpointError):
        self.key = os.path.realpath(directory)
        self.owned = self.key not in _HELD
        try:
            self.note = acquire(directory, flag, error)
        except OSError as e:  # a read-only or full file system, a parent that is a file
            raise error(f"{flag} {directory}: cannot create its lock file {LOCK_NAME} ({e})") from e

    def release(self) -> None:
        if self.owned and self.key in _HELD:
            os.close(_HELD.pop(self.key))
            self.owned = False
