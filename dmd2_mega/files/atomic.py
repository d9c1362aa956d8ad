"""The one all-or-nothing file write of the package (checkpoints, trackers, caches, PNGs, media, indexes).

`atomic_write(path, write)`: `write(f)` fills a temporary file beside `path` (binary, or text with `text=True`).
`atomic_path(path)`: the same for a writer that needs a file name, not a file object (ffmpeg, safetensors'
`save_file`): the block writes the yielded temporary path. Either way the temporary file is then fsynced, given
mode 0644 and `os.replace`d onto `path`, so a reader sees the old file or the whole new one, never a part. On any
failure (a full disk, an exception in the writer, a kill's KeyboardInterrupt) the temporary file is removed and
`path` is untouched. `before_replace()` runs between the fsync and the rename (the checkpoint writer's crash-test
hook).
`durable_replace(src, dst)`: `os.replace` a finished file or folder onto `dst`, then fsync the folder holding
`dst`, so that the rename itself survives a power cut (a checkpoint's iter_N.tmp/ -> iter_N/). If the rename
fails `dst` is untouched; if only the fsync fails `dst` is in place and the OSError propagates.
`write_error_text(e)` says why a write failed (the OSError under any wrapper).
`fsync_path(p)` flushes a file's data, or makes the renames inside a folder durable.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Callable, IO, Iterator, Optional


def fsync_path(path: str) -> None:
    """fsync a file (its data) or a folder (the renames inside it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_replace(src: str, dst: str) -> None:
    os.replace(src, dst)
    fsync_path(os.path.dirname(os.path.abspath(dst)))


@contextlib.contextmanager
def atomic_path(path: str, *, before_replace: Optional[Callable[[], None]] = None) -> Iterator[str]:
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=os.path.basename(path) + ".", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        fsync_path(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write(path: str, write: Callable[[IO], None], *, text: bool = False,
                 before_replace: Optional[Callable[[], None]] = None) -> None:
    with atomic_path(path, before_replace=before_replace) as tmp:
        with open(tmp, "w" if text else "wb") as f:
            write(f)


def write_error_text(e: BaseException) -> str:
    """A failed write in words: the OSError under any wrapper (torch's zip writer turns a full disk into
    `RuntimeError: ... unexpected pos A vs B` whose context is the ENOSPC OSError), else the type and first line."""
    seen, cur = set(), e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, OSError):
            return cur.strerror or str(cur)
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
