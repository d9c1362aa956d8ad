"""The files of one `launch/prepare_data.py` run: resumable shards, index.json, negative.safetensors (captions)
or classes.json (class folders), report.json.

Shard k holds clips k*S .. k*S + S - 1 of the ordered clip list (S = `--shard-size`; rank k % world writes it):
    out/shard_{k:05d}.safetensors
        latents   [n_k, C, (T,) H, W]  --dtype  normalised VAE latents of the shard's n_k readable clips
        cond      [n_k, L, D]          --dtype  their caption embeddings, zeros after text_len    (captions)
        text_len  [n_k]                int64    real tokens per caption (</s> included)           (captions)
        labels    [n_k]                int64    their class indices              (--labels-from-folders)
        metadata  "settings": JSON of everything that changes the values; "clips": the shard's paths and a
                  sha256 of its (path, caption or label) pairs; "written": the paths of the n_k rows;
                  "skipped": [[path, reason], ...]
n_k may be 0 (every clip skipped): the file still marks the shard done, and index.json leaves it out.
Each file is written whole under a temporary name and renamed (`atomic_write`), so a killed run leaves only
finished shards plus stale `shard_*.safetensors.*.tmp` files, which the next run deletes before redoing the
shards that have no file. A shard written with other settings or for other clips is a DataError naming it.
After every rank is done, rank 0 writes negative.safetensors (`cond` [L, D]) or classes.json (the JSON list of
class names: label i is entry i), index.json from the shard headers (no tensor is loaded) and report.json.
"""
import glob
import hashlib
import json
import os
import re
from typing import Dict, List, Sequence, Set, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save

from dmd2_mega.files.atomic import atomic_write
from dmd2_mega.data.shards import INDEX, NEGATIVE
from dmd2_mega.errors import DataError

from .clips import Clip

REPORT = "report.json"
CLASSES = "classes.json"
SHARD_RE = re.compile(r"^shard_(\d{5})\.safetensors$")


def shard_name(k: int) -> str:
    return f"shard_{k:05d}.safetensors"


def plan_shards(clips: Sequence[Clip], shard_size: int) -> List[List[Tuple[int, Clip]]]:
    """The ordered clips with their global index, in chunks of shard_size: chunk k is shard k."""
    numbered = list(enumerate(clips))
    return [numbered[i:i + shard_size] for i in range(0, len(numbered), shard_size)]


def clips_digest(chunk: Sequence[Tuple[int, Clip]]) -> str:
    pairs = [[c.path, c.caption if c.label is None else c.label] for _, c in chunk]
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()


def _metadata(where: str) -> dict:
    try:
        with safe_open(where, framework="pt") as f:
            meta = f.metadata() or {}
            shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        return {"shapes": shapes, **{k: json.loads(v) for k, v in meta.items()}}
    except Exception as e:  # safetensors' own errors, bad JSON: a file this tool did not write
        raise DataError(f"{where}: cannot read as a prepare_data shard ({e}); delete it or use a fresh --out") from e


def finished_shards(out: str, settings: dict, chunks: Sequence[Sequence[Tuple[int, Clip]]]) -> Set[int]:
    """The shards already written under `out` for these settings and clips (a resume); anything else is an error."""
    done = set()
    for name in sorted(os.listdir(out)) if os.path.isdir(out) else []:
        m = SHARD_RE.match(name)
        if not m:
            continue
        k, where = int(m.group(1)), os.path.join(out, name)
        if k >= len(chunks):
            raise DataError(f"--out {out}: {name} exists but this clip list makes only {len(chunks)} shards; "
                            f"it is from another run: use a fresh --out")
        meta = _metadata(where)
        if meta.get("settings") != settings:
            old = meta.get("settings") or {}
            diff = [f"{key} {old.get(key)!r} -> {settings.get(key)!r}" for key in sorted(set(old) | set(settings))
                    if old.get(key) != settings.get(key)]
            raise DataError(f"--out {out}: {name} was written with other settings ({'; '.join(diff)}); "
                            f"use a fresh --out or the same flags")
        if (meta.get("clips") or {}).get("sha256") != clips_digest(chunks[k]):
            raise DataError(f"--out {out}: {name} was written for other clips, captions or labels (the captions "
                            f"file or the class folders changed); use a fresh --out")
        done.add(k)
    return done


def remove_stale(out: str, k: int) -> None:
    """Delete what a killed writer of shard k left behind (atomic_write's temporary files)."""
    for tmp in glob.glob(os.path.join(glob.escape(out), shard_name(k) + ".*.tmp")):
        os.unlink(tmp)


def write_shard(out: str, k: int, tensors: Dict[str, torch.Tensor], settings: dict,
                chunk: Sequence[Tuple[int, Clip]], written: Sequence[str], skipped: Sequence[Tuple[str, str]]) -> None:
    """Shard k, whole or not at all: `tensors` are latents and cond + text_len, or labels (module docstring)."""
    meta = {"settings": settings, "written": list(written), "skipped": [list(s) for s in skipped],
            "clips": {"paths": [c.path for _, c in chunk], "sha256": clips_digest(chunk)}}
    tensors = {name: t.contiguous() if t.is_floating_point() else t.long().contiguous() for name, t in tensors.items()}
    blob = save(tensors, metadata={key: json.dumps(v, ensure_ascii=False) for key, v in meta.items()})
    remove_stale(out, k)
    atomic_write(os.path.join(out, shard_name(k)), lambda f: f.write(blob))


def read_shard_headers(out: str, num_shards: int) -> List[dict]:
    """The metadata and tensor shapes of every shard (headers only); a missing shard is a DataError."""
    heads = []
    for k in range(num_shards):
        where = os.path.join(out, shard_name(k))
        if not os.path.isfile(where):
            raise DataError(f"--out {out}: {shard_name(k)} is missing after every rank finished")
        heads.append(_metadata(where))
    return heads


def write_index(out: str, heads: Sequence[dict], latent_shape: Sequence[int], cond: dict) -> dict:
    """index.json listing the non-empty shards (ShardDataset's format); `cond` is {"cond": "embedding",
    "cond_shape": [L, D]} or {"cond": "labels", "num_classes": K}."""
    shards = [{"file": shard_name(k), "num_samples": h["shapes"]["latents"][0]}
              for k, h in enumerate(heads) if h["shapes"]["latents"][0] > 0]
    if not shards:
        raise DataError(f"--out {out}: no clip could be encoded (every file was skipped; see {REPORT})")
    index = {"shards": shards, "latent_shape": list(latent_shape), **cond}
    atomic_write(os.path.join(out, INDEX), lambda f: json.dump(index, f, indent=1), text=True)
    return index


def write_negative(out: str, cond: torch.Tensor) -> None:
    """negative.safetensors: tensor `cond` [L, D], the negative prompt's embedding."""
    blob = save({"cond": cond.contiguous()})
    atomic_write(os.path.join(out, NEGATIVE), lambda f: f.write(blob))


def write_classes(out: str, classes: Sequence[str]) -> None:
    """classes.json: the class names in label order (label i is entry i)."""
    atomic_write(os.path.join(out, CLASSES), lambda f: json.dump(list(classes), f, indent=0, ensure_ascii=False),
                 text=True)


def build_report(heads: Sequence[dict], resumed: Set[int], seconds: float, world: int, source: Dict) -> Dict:
    """report.json's fields from the shard headers; `source` adds what the captions file lost before any shard
    ({"caption_rows_read": n, "caption_rows_skipped": [{"line", "reason"}, ...]}; {} for class folders)."""
    written = sum(h["shapes"]["latents"][0] for h in heads)
    new = sum(h["shapes"]["latents"][0] + len(h["skipped"]) for k, h in enumerate(heads) if k not in resumed)
    skipped = [{"path": p, "reason": r, "shard": shard_name(k)} for k, h in enumerate(heads) for p, r in h["skipped"]]
    return {**source, "clips_total": written + len(skipped), "clips_written": written,
            "clips_skipped": len(skipped), "shards": len(heads), "shards_resumed": sorted(resumed),
            "clips_this_run": new, "seconds_this_run": round(seconds, 3),
            "clips_per_s": round(new / seconds, 3) if seconds > 0 else None, "world_size": world,
            "settings": heads[0]["settings"] if heads else None, "skipped": skipped}


def write_report(out: str, report: Dict) -> str:
    """report.json, and the human summary (returned, for printing): caption rows read and left out, clips
    written of those listed, files skipped."""
    atomic_write(os.path.join(out, REPORT), lambda f: json.dump(report, f, indent=1, ensure_ascii=False), text=True)
    rows, bad = report.get("caption_rows_read"), report.get("caption_rows_skipped") or []
    read = "" if rows is None else f"{rows} caption rows read, {len(bad)} malformed left out; "
    lines = [f"prepare_data: {read}{report['clips_written']} of {report['clips_total']} clips written to {out} in "
             f"{report['shards']} shards ({len(report['shards_resumed'])} kept from an earlier run); "
             f"{report['clips_this_run']} clips this run in {report['seconds_this_run']:.1f} s "
             f"({report['clips_per_s'] or 0:.2f} clips/s on {report['world_size']} rank(s))"]
    if bad:
        lines.append(f"left out {len(bad)} malformed caption rows:")
        lines += [f"  line {b['line']}: {b['reason']}" for b in bad]
    if report["skipped"]:
        lines.append(f"skipped {report['clips_skipped']} clips:")
        lines += [f"  {s['path']}: {s['reason']}" for s in report["skipped"]]
    lines.append(f"details: {os.path.join(out, REPORT)}")
    return "\n".join(lines)
