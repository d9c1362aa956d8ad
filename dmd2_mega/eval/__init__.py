"""Evaluation of generated samples.

`classifier` (a small CNN trained once on the 8x8 digits and cached), `frechet` (Frechet
distance between Gaussians fitted to feature sets), `digits` (`evaluate_digits` and the
`python -m dmd2_mega.eval.digits samples.npz` CLI), `grid` (PNG sample grids, one row per class).
Submodules are not imported here so that `python -m dmd2_mega.eval.digits` runs cleanly.
"""
import os
import tempfile


class EvalInputError(ValueError):
    """Bad input to an evaluation function or file; the message names what was expected."""


def atomic_write(path, write) -> None:
    """Write a file all-or-nothing: `write(f)` fills a temp file beside `path` (mode 0644), which
    then replaces `path`; on any failure the temp file is removed and `path` is untouched."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
