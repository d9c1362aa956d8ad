"""Per-sample reads from safetensors files: the header alone at open time, then only the rows asked for.

The safetensors layout (documented by the format): 8 bytes little-endian u64 `n`, then `n` bytes of JSON
    {"<name>": {"dtype": "BF16", "shape": [N, ...], "data_offsets": [begin, end]}, ..., "__metadata__": {...}}
then the data; a tensor's bytes are `8 + n + begin .. 8 + n + end`, row-major. Row i of a tensor [N, ...]
therefore starts at `8 + n + begin + i * row_bytes`.

`read_header(path)` parses and checks the header (offsets inside the file, sizes consistent with dtype x
shape, a truncated file caught here) without reading tensor data, and stamps the version of the file it read
(`FileStamp`: device and inode, size, mtime, from the open file). `RowFile.read_into(name, rows, out, at)` reads
the given rows straight into a preallocated tensor of the stored dtype with one `os.preadv` per run of
consecutive rows: no intermediate copy, no memory map, so host memory holds exactly the rows read (a memory map would keep every page it
touched resident until closed), and positional reads are safe in forked DataLoader workers.

A file must stay the version its header was read from: a `RowFile` given the stamp compares it with an `fstat` of
its descriptor when it opens and on every `check()` (one system call, no data read), and after a short read,
and raises `FileChanged` saying what differs: deleted (unlinked, even while open), replaced by another file
under its name, truncated or grown, or modified in place (same size, another mtime). Without the check a file
deleted while open would still be read from the old inode, and one rewritten in place would be read mixed.
"""
from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
MAX_HEADER = 100 * 2**20  # the format's own limit


class HeaderError(ValueError):
    """A file that is not a well-formed safetensors file; the caller names it."""


class FileChanged(ValueError):
    """A file that is no longer the version its header was read from; the message says what differs, the caller
    names the file."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: Tuple[int, ...]
    offset: int  # absolute byte offset of element 0 in the file

    @property
    def row_bytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape[1:]:
            n *= s
        return n


def _when(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns // 10**9)) + f".{ns % 10**9:09d}"


@dataclass(frozen=True)
class FileStamp:
    """One version of a file: what `os.fstat` says of it when its header is read."""
    dev: int
    ino: int
    size: int
    mtime_ns: int
    needed: int  # the bytes its header needs (<= size)

    @classmethod
    def of(cls, st: os.stat_result, needed: int) -> "FileStamp":
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, needed)

    def change(self, path: str, fd: Optional[int] = None) -> Optional[str]:
        """What differs now in the file `path` (read through the open descriptor `fd`, if given), in words, or
        None when it is still this version."""
        try:
            now = os.fstat(fd) if fd is not None else os.stat(path)
            if now.st_nlink == 0:  # unlinked while open: gone, or another file under its name
                now = os.stat(path)
        except FileNotFoundError:
            return f"deleted ({self.size} bytes at start-up)"
        if (now.st_dev, now.st_ino) != (self.dev, self.ino):
            return f"replaced by another file (inode {self.ino} at start-up, now {now.st_ino})"
        if now.st_size < self.needed:
            return f"truncated to {now.st_size} bytes (its header needs {self.needed}; {self.size} at start-up)"
        if now.st_size != self.size:
            return f"now {now.st_size} bytes, {self.size} at start-up"
        if now.st_mtime_ns != self.mtime_ns:
            return f"modified (same size; mtime {_when(self.mtime_ns)} at start-up, now {_when(now.st_mtime_ns)})"
        return None


def read_header(path: str) -> Tuple[Dict[str, TensorInfo], FileStamp]:
    """The tensors of one safetensors file, from its header only, and the stamp of the version read; HeaderError
    if malformed or truncated."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        size = st.st_size
        head = f.read(8)
        if len(head) < 8:
            raise HeaderError(f"{size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise HeaderError(f"header length {n} does not fit the file's {size} bytes")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HeaderError(f"header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise HeaderError("header is not a JSON object")
    out, end_max = {}, 0
    for name, h in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = DTYPES[h["dtype"]], tuple(int(s) for s in h["shape"]), h["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise HeaderError(f"tensor {name!r}: unsupported or malformed entry {h!r}") from e
        numel = 1
        for s in shape:
            numel *= s
        if not 0 <= begin <= end or end - begin != numel * dtype.itemsize:
            raise HeaderError(f"tensor {name!r}: data offsets {[begin, end]} do not hold {h['dtype']} {list(shape)}")
        out[name] = TensorInfo(dtype, shape, 8 + n + begin)
        end_max = max(end_max, end)
    if 8 + n + end_max > size:
        raise HeaderError(f"truncated: the header needs {8 + n + end_max} bytes, the file has {size}")
    return out, FileStamp.of(st, 8 + n + end_max)


class RowFile:
    """One open safetensors file read by rows (see the module docstring); with `stamp`, only while it is still
    that version of the file (FileChanged otherwise)."""

    def __init__(self, path: str, tensors: Dict[str, TensorInfo], stamp: Optional[FileStamp] = None):
        self.path, self.tensors, self.stamp, self.fd = path, tensors, stamp, None
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            if stamp is None:
                raise
            raise FileChanged(stamp.change(path) or f"deleted ({stamp.size} bytes at start-up)") from None
        try:
            self.check()
        except FileChanged:
            self.close()
            raise

    def check(self) -> None:
        """FileChanged if the file is no longer the stamped version (one fstat; nothing without a stamp)."""
        what = self.stamp.change(self.path, self.fd) if self.stamp is not None else None
        if what is not None:
            raise FileChanged(what)

    def read(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """rows int64 [k] (any order) -> tensor [k, *shape[1:]] in the stored dtype."""
        info = self.tensors[name]
        out = torch.empty((rows.numel(), *info.shape[1:]), dtype=info.dtype)
        self.read_into(name, rows, out, torch.arange(rows.numel()))
        return out

    def read_into(self, name: str, rows: torch.Tensor, out: torch.Tensor, at: torch.Tensor) -> None:
        """Rows `rows` of tensor `name` into out[at] (out: contiguous, the stored dtype): one positional read per run
        of rows that are consecutive in the file and in `out`, straight into out's memory."""
        info = self.tensors[name]
        rb = info.row_bytes
        if rb == 0 or rows.numel() == 0:
            return
        flat = out.view(-1).view(torch.uint8).numpy().reshape(out.shape[0], rb)
        r, a = rows.tolist(), at.tolist()
        start = 0
        for k in range(1, len(r) + 1):
            if k == len(r) or r[k] != r[k - 1] + 1 or a[k] != a[k - 1] + 1:
                self._read_into(memoryview(flat[a[start]:a[start] + k - start]).cast("B"),
                                info.offset + r[start] * rb, name)
                start = k

    def _read_into(self, buf: memoryview, offset: int, name: str) -> None:
        done = 0
        while done < len(buf):  # Linux returns at most ~2 GiB per call
            got = os.preadv(self.fd, [buf[done:]], offset + done)
            if got <= 0:
                self.check()
                raise OSError(f"{self.path}: short read of {name!r} at byte {offset + done} (file changed?)")
            done += got

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
