"""A whole output written beside its final path and renamed into place as the last step: all or nothing.

The exports (`--to-diffusers DIR`, `--to-official FILE`, and any later one such as a LoRA-only export) and the
conversions' `--save DIR` write through `staged_output`, the way a checkpoint goes iter_N.tmp/ -> iter_N/:

    check_free(out, "--to-diffusers", folder=True, advice="export into a new directory")   # before any reading
    with staged_output(out, "--to-diffusers", folder=True, advice=..., log=log) as where:
        ... write every file under `where` ...

    <out>.partial/                    the temporary sibling, locked by this run (`dir_lock`: <out>.partial/.dmd2_mega.lock)
    <out>.partial/<name of out>       `where`: what is written (a folder, or one file)
After the block every file under `where` is fsynced (a deferred write error of a full disk surfaces here, not
after the rename), `where` is renamed onto `out` (which must not exist, or be an empty folder for a folder
output) and <out>.partial/ is removed. If the block raises, <out>.partial/ is removed and the error is re-raised;
a failed write (OSError, torch's RuntimeError, safetensors' error, a CheckpointError of a writer) becomes ONE
CheckpointError naming the flag and `out`. A SIGKILL leaves only <out>.partial/, which no finished output looks
like; the next run on `out` removes it, with a line saying so. A second run on the same `out` while one is
writing stops at the lock, naming the holder. A <out>.partial/ without the lock file is not ours: refused, never
deleted.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from typing import Callable, Iterator

from dmd2_mega.files.atomic import fsync_path, write_error_text
from dmd2_mega.files.dir_lock import LOCK_NAME, DirLock
from dmd2_mega.errors import CheckpointError, ConfigError, DataError

SUFFIX = ".partial"


def check_free(out: str, flag: str, folder: bool, advice: str) -> None:
    """ConfigError unless `out` is free for a new output: absent, or (a folder output) an empty folder; and under
    folders (its nearest existing parent is a directory, not a file)."""
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{flag} {out} lies under {parent}, which is not a directory; expected a path under a "
                          f"directory; {advice} (nothing was written)")
    if folder and os.path.isfile(out):
        raise ConfigError(f"{flag} {out} is a file; expected a directory to create; {advice} (nothing was written)")
    if folder and os.path.isdir(out) and os.listdir(out):
        raise ConfigError(f"{flag} {out} exists and is not empty; {advice} (nothing was written)")
    if not folder and os.path.lexists(out):
        raise ConfigError(f"{flag} {out} exists already; {advice} (nothing was written)")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _fsync_tree(path: str) -> None:
    """fsync every file and folder under `path` (or the file `path`), then the folder holding it."""
    for root, _, files in os.walk(path) if os.path.isdir(path) else [(os.path.dirname(path), [], [path])]:
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_path(root)


def _failure(e: BaseException, flag: str, out: str, staging: str) -> CheckpointError:
    detail = str(e) if isinstance(e, CheckpointError) else write_error_text(e)  # a writer's own line: as it is
    detail = detail.replace(os.path.join(staging, os.path.basename(out)), out)
    return CheckpointError(f"writing {flag} {out} failed: {detail}; nothing was kept at {out}")


@contextlib.contextmanager
def staged_output(out: str, flag: str, folder: bool, advice: str, log: Callable = print) -> Iterator[str]:
    """Yields the path to write `out` at (module docstring); `folder`: `out` is a folder (created empty for the
    block), else one file; `advice` ends the refusal when `out` is taken ("export into a new directory")."""
    out = out.rstrip(os.sep) or out
    staging = out + SUFFIX
    where = os.path.join(staging, os.path.basename(out))
    if os.path.isdir(staging) and os.listdir(staging) and not os.path.exists(os.path.join(staging, LOCK_NAME)):
        raise ConfigError(f"{staging} (the temporary folder of {flag} {out}) exists and was not made by dmd2-mega "
                          f"(no {LOCK_NAME}); move it away (nothing was written)")
    lock = DirLock(staging, flag)  # a folder it cannot create is one CheckpointError line of DirLock's
    committed = False
    try:
        left = sorted(n for n in os.listdir(staging) if n != LOCK_NAME)
        for name in left:
            _remove(os.path.join(staging, name))
        if left:
            log(f"> removed {staging}, left by an earlier {flag} {out} that did not finish (killed?)")
        check_free(out, flag, folder, advice)
        try:
            if folder:
                os.makedirs(where)
            yield where
            _fsync_tree(where)
            os.rename(where, out)
            committed = True
            fsync_path(os.path.dirname(os.path.abspath(out)))
        except (ConfigError, DataError):
            raise
        except Exception as e:
            if committed:  # only the last fsync failed: the output is whole and in place
                raise CheckpointError(f"{flag} {out} was written, but syncing its parent folder failed: {e}") from None
            raise _failure(e, flag, out, staging) from None
    finally:
        for step in (lambda: _remove(where), lambda: os.unlink(os.path.join(staging, LOCK_NAME)),
                     lambda: os.rmdir(staging)):
            with contextlib.suppress(OSError):
                step()
        lock.release()
