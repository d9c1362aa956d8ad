"""The shard format's checks: index.json, each shard's safetensors header, and the values of what is read.

Start-up (`read_index`, `check_shard`) reads index.json and each shard's header only: each listed file lies
inside the data directory (a relative name; no '..' or symlink out of it) and is listed once (after resolving
both), exists and is whole (not truncated), and holds the named tensors with the expected shapes and dtypes;
`check_shard` returns the stamp of the version whose header it read, which the reader holds the file to for
the rest of the run (`safetensors_rows.FileStamp`). The values
(finite floats, labels in range) are checked on every batch as it is read (`bad_values`), so a
terabyte-sized set opens in the time it takes to read its headers. Every failure is one `DataError` line that
names the file and what was expected vs found. The format itself is documented in `shards.py`.
"""
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from dmd2_mega.errors import DataError
from dmd2_mega.files.json_file import read_json
from .dataset import check_parts
from .safetensors_rows import FileStamp, HeaderError, RowFile, TensorInfo, read_header

INDEX = "index.json"
NEGATIVE = "negative.safetensors"
TEXT_LEN = "text_len"


def _int_list(value, n: Optional[int], where: str, key: str) -> List[int]:
    ok = isinstance(value, list) and all(isinstance(v, int) and v > 0 for v in value)
    if not ok or (n is not None and len(value) != n):
        want = f"a list of {n} positive ints" if n is not None else "a list of positive ints"
        raise DataError(f"{where}: '{key}' must be {want}, found {value!r}")
    return value


def read_index(path: str) -> dict:
    """index.json of the shard directory `path`, with its structure checked."""
    index_path = os.path.join(path, INDEX)
    if not os.path.isdir(path):
        raise DataError(f"--data {path}: not a directory (expected {INDEX} plus safetensors shards)")
    if not os.listdir(path):
        raise DataError(f"--data {path}: empty data directory (expected {INDEX} plus safetensors shards)")
    if not os.path.isfile(index_path):
        raise DataError(f"{index_path}: missing; a shard directory needs {INDEX} listing its shards")
    index = read_json(index_path, error=DataError)
    shards = index.get("shards")
    if not isinstance(shards, list) or not shards:
        raise DataError(f"{index_path}: 'shards' must be a non-empty list of "
                        f"{{'file', 'num_samples'}}, found {shards!r}")
    for s in shards:
        if not (isinstance(s, dict) and isinstance(s.get("file"), str)
                and isinstance(s.get("num_samples"), int) and s["num_samples"] > 0):
            raise DataError(f"{index_path}: bad shard entry {s!r}; expected "
                            f"{{'file': str, 'num_samples': positive int}}")
    _check_files(path, index_path, [s["file"] for s in shards])
    shape = _int_list(index.get("latent_shape"), None, index_path, "latent_shape")
    if len(shape) not in (3, 4):
        raise DataError(f"{index_path}: 'latent_shape' must be [C, H, W] or [C, T, H, W], found {shape}")
    kind = index.get("cond")
    if kind == "labels":
        k = index.get("num_classes")
        if not isinstance(k, int) or k < 1:
            raise DataError(f"{index_path}: cond 'labels' needs 'num_classes' >= 1, found {k!r}")
    elif kind == "embedding":
        _int_list(index.get("cond_shape"), None, index_path, "cond_shape")
        if index.get("cond_parts") is not None:  # a condition of parts, flat in 'cond' (checked by the dataset)
            check_parts(index["cond_parts"], tuple(index["cond_shape"]), index_path)
    else:
        raise DataError(f"{index_path}: 'cond' must be 'labels' or 'embedding', found {kind!r}")
    return index


def _check_files(path: str, index_path: str, files: List[str]) -> None:
    """Each shard file lies inside the directory `path` (symlinks and '..' resolved) and is listed once."""
    root = os.path.realpath(path)
    seen: Dict[str, int] = {}
    for i, name in enumerate(files):
        if os.path.isabs(name):
            raise DataError(f"{index_path}: shard entry {i} {name!r} is an absolute path; entries are file names "
                            f"relative to the data directory {path}")
        real = os.path.realpath(os.path.join(root, name))
        if os.path.commonpath([root, real]) != root:
            raise DataError(f"{index_path}: shard entry {i} {name!r} resolves to {real}, outside the data "
                            f"directory {root}; a set lists only its own files (no '..', no symlink out of it)")
        if real in seen:
            j = seen[real]
            raise DataError(f"{index_path}: lists the shard {real} twice (entries {j} {files[j]!r} and {i} "
                            f"{name!r}); each shard may be listed once")
        seen[real] = i


def cond_key(index: dict) -> str:
    return "labels" if index["cond"] == "labels" else "cond"


def _check_info(info: TensorInfo, shape: Sequence[int], floating: bool, where: str, key: str) -> None:
    if tuple(info.shape) != tuple(shape):
        raise DataError(f"{where}: '{key}' expected shape {list(shape)}, found {list(info.shape)}")
    if floating and not info.dtype.is_floating_point:
        raise DataError(f"{where}: '{key}' expected a floating dtype (float32/bfloat16/float16), found {info.dtype}")
    if not floating and (info.dtype.is_floating_point or info.dtype == torch.bool):
        raise DataError(f"{where}: '{key}' expected an integer dtype (int64), found {info.dtype}")


def header(where: str) -> Tuple[Dict[str, TensorInfo], FileStamp]:
    """The tensors of one safetensors file from its header, and the stamp of the version read; a missing,
    unreadable or truncated file is a DataError."""
    if not os.path.isfile(where):
        raise DataError(f"{where}: shard listed in {INDEX} is missing")
    try:
        return read_header(where)
    except (HeaderError, OSError) as e:
        raise DataError(f"{where}: cannot read as safetensors ({e})") from e


def check_shard(path: str, entry: dict, index: dict) -> Tuple[Dict[str, TensorInfo], FileStamp]:
    """One shard's header against index.json (names, shapes, dtypes, whole file), and the stamp of the version
    checked; reads no tensor data."""
    where = os.path.join(path, entry["file"])
    tensors, stamp = header(where)
    key, n = cond_key(index), entry["num_samples"]
    for name in ("latents", key):
        if name not in tensors:
            raise DataError(f"{where}: expected tensor '{name}', found keys {sorted(tensors)}")
    _check_info(tensors["latents"], [n, *index["latent_shape"]], True, where, "latents")
    if key == "labels":
        _check_info(tensors["labels"], [n], False, where, "labels")
    else:
        _check_info(tensors["cond"], [n, *index["cond_shape"]], True, where, "cond")
    if TEXT_LEN in tensors:
        _check_info(tensors[TEXT_LEN], [n], False, where, TEXT_LEN)
    return tensors, stamp


def bad_values(t: torch.Tensor, key: str, num_classes: Optional[int] = None) -> Optional[Tuple[int, str]]:
    """(the first bad row, what is wrong) of rows just read, or None: floats must be finite, labels in
    [0, num_classes)."""
    if t.is_floating_point() and t.numel():
        rows_of = t.view(t.shape[0], -1)  # max and min propagate NaN and reach +-inf: ~10x cheaper than isfinite
        finite = torch.isfinite(rows_of.amax(dim=1)) & torch.isfinite(rows_of.amin(dim=1))
        if not bool(finite.all()):
            first = int((~finite).nonzero()[0, 0])
            return first, f"'{key}' has {int((~torch.isfinite(t[first])).sum())} non-finite values (NaN/inf)"
    elif num_classes is not None and t.numel():
        bad = (t < 0) | (t >= num_classes)
        if bool(bad.any()):
            first = int(bad.nonzero()[0, 0])
            return first, f"'labels' expected values in [0, {num_classes}), found {int(t[first])}"
    return None


def read_negative(path: str, cond_shape: Sequence[int]) -> torch.Tensor:
    """<path>/negative.safetensors' tensor 'cond' [*cond_shape] (the negative-prompt embedding), checked."""
    where = os.path.join(path, NEGATIVE)
    tensors, _ = header(where)
    if "cond" not in tensors:
        raise DataError(f"{where}: expected tensor 'cond', found keys {sorted(tensors)}")
    _check_info(tensors["cond"], list(cond_shape), True, where, "cond")
    f = RowFile(where, {"cond": TensorInfo(tensors["cond"].dtype, (1, *cond_shape), tensors["cond"].offset)})
    try:
        neg = f.read("cond", torch.zeros(1, dtype=torch.int64))[0]
    finally:
        f.close()
    bad = bad_values(neg[None], "cond")
    if bad is not None:
        raise DataError(f"{where}: {bad[1]}")
    return neg.float()
