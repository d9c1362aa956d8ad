"""The captions file -> the sorted clip list, checked before any encoding.

`--captions FILE`: a CSV with a header holding the columns `path` and `caption`, or JSON lines
(.jsonl / .json, one object per line) with the keys `path` and `caption`. `path` is relative to
`--media DIR`. The clip list is sorted by path, so the shard a clip lands in (clip i -> shard
i // shard_size) does not depend on the file's order or on the number of ranks. Errors name the file
and line: a missing column, a non-string value, an absolute or escaping path, a duplicate path, an
extension the VAE cannot take (videos for AutoencoderKLWan, and images when --frames is 1; images for
AutoencoderKL). A missing media file is not an error here: the writer skips and reports it.
"""
import csv
import json
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence

from dmd2_mega.errors import DataError

from .media import IMAGE_EXT, VIDEO_EXT


@dataclass(frozen=True, slots=True)
class Clip:
    """One media file to encode and its condition: a caption (--captions) or a class label (folders.py)."""
    path: str                       # relative to --media
    caption: Optional[str] = None
    label: Optional[int] = None     # --labels-from-folders: the class folder's index


def _rows(path: str):
    """(line number, dict) pairs of the CSV / JSONL file."""
    ext = os.path.splitext(path)[1].lower()
    with open(path, newline="" if ext == ".csv" else None, encoding="utf-8") as f:
        if ext == ".csv":
            reader = csv.DictReader(f)
            missing = {"path", "caption"} - set(reader.fieldnames or [])
            if missing:
                raise DataError(f"--captions {path}: the CSV header must name the columns 'path' and 'caption'; "
                                f"found {reader.fieldnames}")
            for row in reader:
                yield reader.line_num, row
        elif ext in (".jsonl", ".json"):
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"--captions {path} line {n}: not a JSON object ({e})") from e
                if not isinstance(row, dict):
                    raise DataError(f"--captions {path} line {n}: expected an object with 'path' and 'caption'")
                yield n, row
        else:
            raise DataError(f"--captions {path}: expected a .csv or .jsonl file, found '{ext}'")


def allowed_extensions(kind: str, frames: int) -> Sequence[str]:
    """The media the VAE takes: videos for "wan" (plus images when frames == 1), images for "kl"."""
    if kind == "wan":
        return VIDEO_EXT + (IMAGE_EXT if frames == 1 else ())
    return IMAGE_EXT


def read_captions(path: str, kind: str, frames: int) -> List[Clip]:
    """The checked, path-sorted clips of the captions file (module docstring)."""
    if not path or not os.path.isfile(path):
        raise DataError(f"--captions {path}: no such file (expected a CSV or JSONL with 'path' and 'caption')")
    allowed = allowed_extensions(kind, frames)
    seen = {}
    try:
        for line, row in _rows(path):
            rel, caption = row.get("path"), row.get("caption")
            if not isinstance(rel, str) or not rel or not isinstance(caption, str):
                raise DataError(f"--captions {path} line {line}: 'path' and 'caption' must be strings, found "
                                f"path={rel!r} caption={caption!r}")
            norm = os.path.normpath(rel)
            if os.path.isabs(rel) or norm.startswith(".."):
                raise DataError(f"--captions {path} line {line}: path {rel!r} must be relative to --media and "
                                f"inside it")
            ext = os.path.splitext(rel)[1].lower()
            if ext not in allowed:
                what = "a video VAE" if kind == "wan" else "an image VAE"
                raise DataError(f"--captions {path} line {line}: {rel!r} has extension '{ext}'; with {what} and "
                                f"--frames {frames} the media must be one of {' '.join(allowed)}")
            if norm in seen:
                raise DataError(f"--captions {path} line {line}: path {rel!r} is listed twice (first on line "
                                f"{seen[norm][0]})")
            seen[norm] = (line, caption)
    except UnicodeDecodeError as e:
        raise DataError(f"--captions {path}: not UTF-8 text ({e})") from e
    if not seen:
        raise DataError(f"--captions {path}: no clips listed")
    return [Clip(p, seen[p][1]) for p in sorted(seen)]
