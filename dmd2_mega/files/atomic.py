"""The one all-or-nothing file write of the package (checkpoints, trackers, caches, PNGs, indexes).

`atomic_write(path, write)`: `write(f)` fills a temporary file beside `path` (binary, or text with
`text=True`), which is flushed and fsynced, given mode 0644 and then `os.replace`d onto `path`, so a
reader sees the old file or the whole new one, never a part. On any failure (a full disk, an
exception in `write`) the temporary file is removed and `path` is untouched. `before_replace()` runs
between the fsync and the rename (the checkpoint writer's crash-test hook). `fsync_dir(d)` makes a
rename inside `d` durable.
"""
from __future__ import annotations

import os
import tempfile
from typing import Callable, IO, Optional


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[IO], None], *, text: bool = False,
                 before_replace: Optional[Callable[[], None]] = None) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w" if text else "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
