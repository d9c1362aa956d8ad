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
`fsync_dir(d)` makes a rename inside `d` durable.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Callable, IO, Iterator, Optional


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_replace(src: str, dst: str) -> None:
    os.replace(src, dst)
    fsync_dir(os.path.dirname(os.path.abspath(dst)))


@contextlib.contextmanager
def atomic_path(path: str, *, before_replace: Optional[Callable[[], None]] = None) -> Iterator[str]:
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=os.path.basename(path) + ".", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
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
