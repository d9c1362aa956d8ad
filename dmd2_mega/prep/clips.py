"""The captions file -> the sorted clip list, checked before any encoding.

`--captions FILE`: a CSV with a header holding the columns `path` and `caption`, or JSON lines
(.jsonl / .json, one object per line) with the keys `path` and `caption`. `path` is relative to
`--media DIR`. The clip list is sorted by path, so the shard a clip lands in (clip i -> shard
i // shard_size) does not depend on the file's order or on the number of ranks.

The CSV is parsed strictly, record by record (a record is one line, or more inside a quoted field). A
malformed row is one with another field count than the header (an unquoted comma in a caption), one that
is not valid CSV (a stray quote; an over-long field, csv's limit of 131072 characters; the end of the file
inside a quote), or one whose quoted field runs on over lines that read as rows of the file themselves (a
quote left open swallows the rows after it; a quoted caption that merely holds a line break is kept). A
JSONL row is malformed when it is not a JSON object with string values for `path` and `caption`. Each
malformed row is named by its first line, and parsing resumes on the line after it, so one bad row costs
one clip, not the rows it swallowed. `read_captions` refuses the file when it has any (DataError listing
them), or with `skip_bad=True` (`--skip-bad-captions`) leaves them out and returns them for report.json.
Also errors naming the file and line: an absolute or escaping path, a duplicate path, an extension the VAE
cannot take (videos for AutoencoderKLWan, and images when --frames is 1; images for AutoencoderKL). A
missing media file is not an error here: the writer skips and reports it.
"""
import csv
import json
import os
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

from dmd2_mega.errors import DataError

from .media import IMAGE_EXT, VIDEO_EXT

MEDIA_EXT = VIDEO_EXT + IMAGE_EXT
SHOWN = 3  # malformed rows quoted in the refusal (all of them go to report.json with --skip-bad-captions)


@dataclass(frozen=True, slots=True)
class Clip:
    """One media file to encode and its condition: a caption (--captions) or a class label (folders.py)."""
    path: str                       # relative to --media
    caption: Optional[str] = None
    label: Optional[int] = None     # --labels-from-folders: the class folder's index


@dataclass(frozen=True)
class Captions:
    """What read_captions found: the clips, and the rows it read and left out."""
    clips: List[Clip]               # path-sorted
    rows: int                       # rows read (blank lines and the CSV header aside), malformed ones included
    bad: List[dict]                 # the malformed rows skipped: {"line": first line, "reason": ...}


Row = Tuple[int, Optional[dict], str]  # (first line, the row's fields or None, why it is malformed or "")


def _csv_rows(lines: Sequence[str]) -> Iterator[Row]:
    """The records of a CSV file's lines (module docstring), the header's names as the keys."""
    pos = 0  # lines consumed

    def feed():
        nonlocal pos
        while pos < len(lines):
            pos += 1
            yield lines[pos - 1]

    reader = csv.reader(feed(), strict=True)
    try:
        header = next(reader, [])
    except csv.Error as e:
        raise DataError(f"line 1: the CSV header is not valid CSV ({e})") from e
    missing = {"path", "caption"} - set(header)
    if missing:
        raise DataError(f"the CSV header must name the columns 'path' and 'caption'; found {header}")
    path_col = header.index("path")
    while True:
        start = pos + 1
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as e:  # a stray quote, csv's field limit, the end of the file inside a quote
            reason = f"not valid CSV ({e}, reading lines {start}-{pos}): a quote left open or a stray quote?"
            yield start, None, reason
            pos = start  # resume on the next line, with a fresh reader
            reader = csv.reader(feed(), strict=True)
            continue
        if not fields:
            continue
        if pos > start and any(_reads_as_row(line, len(header), path_col) for line in lines[start:pos]):
            yield start, None, (f"its quoted field runs on over lines {start + 1}-{pos}, which read as rows of "
                                f"this file: close the quote")
            pos = start
            reader = csv.reader(feed(), strict=True)
            continue
        if len(fields) != len(header):
            yield start, None, (f"{len(fields)} fields where the header has {len(header)} ({','.join(header)}): "
                                f"quote a caption that holds a comma")
            continue
        yield start, dict(zip(header, fields)), ""


def _reads_as_row(line: str, width: int, path_col: int) -> bool:
    """Whether one line on its own is a CSV row of `width` fields whose path is a media file."""
    try:
        fields = next(csv.reader([line], strict=True), [])
    except csv.Error:
        return False
    return len(fields) == width and fields[path_col].strip().lower().endswith(MEDIA_EXT)


def _jsonl_rows(lines: Sequence[str]) -> Iterator[Row]:
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            yield n, None, f"not a JSON object ({e})"
            continue
        if not isinstance(row, dict):
            yield n, None, f"expected an object with 'path' and 'caption', found {type(row).__name__}"
            continue
        yield n, row, ""


def read_rows(path: str, flag: str = "--captions") -> Iterator[Row]:
    """(first line, fields, reason) of each row of the CSV / JSONL file in file order; reason is "" for a
    well-formed row. Errors name `flag` and the file (also read for --images: `image.read_image_prompts`)."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".csv", ".jsonl", ".json"):
        raise DataError(f"{flag} {path}: expected a .csv or .jsonl file, found '{ext}'")
    try:
        with open(path, newline="" if ext == ".csv" else None, encoding="utf-8-sig") as f:
            lines = f.readlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{flag} {path}: not UTF-8 text ({e})") from e
    try:
        yield from (_csv_rows if ext == ".csv" else _jsonl_rows)(lines)
    except DataError as e:
        raise DataError(f"{flag} {path}: {e}") from e


def allowed_extensions(video: bool, frames: int) -> Sequence[str]:
    """The media the VAE takes: videos for a video VAE (plus images when frames == 1), images for an image VAE."""
    if video:
        return VIDEO_EXT + (IMAGE_EXT if frames == 1 else ())
    return IMAGE_EXT


def read_captions(path: str, video: bool, frames: int, skip_bad: bool = False) -> Captions:
    """The checked, path-sorted clips of the captions file (module docstring); malformed rows refuse the file
    unless skip_bad."""
    if not path or not os.path.isfile(path):
        raise DataError(f"--captions {path}: no such file (expected a CSV or JSONL with 'path' and 'caption')")
    allowed = allowed_extensions(video, frames)
    seen, bad, rows = {}, [], 0
    for line, row, reason in read_rows(path):
        rows += 1
        if not reason:
            rel, caption = row.get("path"), row.get("caption")
            if not isinstance(rel, str) or not rel or not isinstance(caption, str):
                reason = f"'path' and 'caption' must be strings, found path={rel!r} caption={caption!r}"
        if reason:
            bad.append({"line": line, "reason": reason})
            continue
        norm = os.path.normpath(rel)
        if os.path.isabs(rel) or norm.startswith(".."):
            raise DataError(f"--captions {path} line {line}: path {rel!r} must be relative to --media and "
                            f"inside it")
        ext = os.path.splitext(rel)[1].lower()
        if ext not in allowed:
            what = "a video VAE" if video else "an image VAE"
            raise DataError(f"--captions {path} line {line}: {rel!r} has extension '{ext}'; with {what} and "
                            f"--frames {frames} the media must be one of {' '.join(allowed)}")
        if norm in seen:
            raise DataError(f"--captions {path} line {line}: path {rel!r} is listed twice (first on line "
                            f"{seen[norm][0]})")
        seen[norm] = (line, caption)
    if bad and not skip_bad:
        shown = "; ".join(f"line {b['line']}: {b['reason']}" for b in bad[:SHOWN])
        more = f"; and {len(bad) - SHOWN} more" if len(bad) > SHOWN else ""
        raise DataError(f"--captions {path}: {len(bad)} malformed of {rows} rows ({shown}{more}); fix the file, "
                        f"or pass --skip-bad-captions to leave them out (listed in report.json)")
    if not seen:
        raise DataError(f"--captions {path}: no clips listed" + (f" ({len(bad)} malformed rows left out)" if bad
                                                                 else ""))
    return Captions([Clip(p, seen[p][1]) for p in sorted(seen)], rows, bad)
