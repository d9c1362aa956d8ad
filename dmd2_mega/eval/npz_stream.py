"""An .npz written as it goes: arrays of N rows that are never held whole (launch/sample.py's samples.npz).

An .npz is a zip of `<name>.npy` members (np.savez: stored, not compressed). Each array is declared with its
final shape [N, ...] and dtype, so its .npy header can be written before its rows; then `write(name, rows)`
appends rows in order, any arrays interleaved. The first declared array streams straight into its zip member;
a zip member must be written in one piece, so the others' rows go to a temporary file beside the output and
are copied in (in bounded chunks) by `close`, which checks that every array got exactly its N rows. Memory is
O(rows per write + CHUNK), disk O(N). `np.load` reads the result as it reads np.savez's.
"""
from __future__ import annotations

import contextlib
import shutil
import tempfile
import zipfile
from typing import Dict, IO, Tuple

import numpy as np

CHUNK = 1 << 22
"""Bytes copied at a time from a spooled array into the zip."""


class NpzStream:
    """`NpzStream(f, {name: (shape, dtype)}, spool_dir)` over a binary file `f`; `write`, then `close`."""

    def __init__(self, f: IO[bytes], arrays: Dict[str, Tuple[tuple, np.dtype]], spool_dir: str):
        self.zip = zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True)
        self.specs = {name: (tuple(shape), np.dtype(dtype)) for name, (shape, dtype) in arrays.items()}
        self.rows = {name: 0 for name in self.specs}
        self.first = next(iter(self.specs))
        self.member = self.zip.open(f"{self.first}.npy", mode="w", force_zip64=True)
        self._header(self.member, self.first)
        self.spools = {name: tempfile.TemporaryFile(dir=spool_dir, prefix=".npz-spool-") for name in self.specs
                       if name != self.first}

    def _header(self, out: IO[bytes], name: str) -> None:
        shape, dtype = self.specs[name]
        np.lib.format.write_array_header_1_0(out, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                   "fortran_order": False, "shape": shape})

    def write(self, name: str, rows) -> None:
        """Append rows [k, *shape[1:]] (cast to the declared dtype) to array `name`."""
        shape, dtype = self.specs[name]
        rows = np.ascontiguousarray(rows, dtype=dtype)
        if rows.shape[1:] != shape[1:] or self.rows[name] + rows.shape[0] > shape[0]:
            raise ValueError(f"samples.npz '{name}': rows {list(rows.shape)} after {self.rows[name]} do not fit "
                             f"{list(shape)}")
        self.rows[name] += rows.shape[0]
        (self.member if name == self.first else self.spools[name]).write(rows.tobytes())

    def close(self) -> None:
        """Finish the archive: every array must hold its declared rows."""
        short = {n: r for n, r in self.rows.items() if r != self.specs[n][0][0]}
        if short:
            raise ValueError(f"samples.npz: arrays {short} got fewer rows than declared")
        self.member.close()
        for name, spool in self.spools.items():
            spool.seek(0)
            with self.zip.open(f"{name}.npy", mode="w", force_zip64=True) as out:
                self._header(out, name)
                shutil.copyfileobj(spool, out, CHUNK)
            spool.close()
        self.zip.close()

    def abort(self) -> None:
        """Drop the spooled rows and close the archive while its file is open (the caller removes the unfinished
        file; a write that fails again here, e.g. on a full disk, is ignored)."""
        for spool in self.spools.values():
            spool.close()
        with contextlib.suppress(Exception):
            self.member.close()
        with contextlib.suppress(Exception):
            self.zip.close()
