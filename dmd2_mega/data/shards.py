"""Precomputed latents + conditions in safetensors shards: the format behind `--data <dir>`, read streaming.

Directory layout:
    <dir>/index.json
    <dir>/shard_00000.safetensors, shard_00001.safetensors, ...
    <dir>/negative.safetensors            (optional, text data: the negative prompt)

index.json (class labels):
    {"shards": [{"file": "shard_00000.safetensors", "num_samples": 1024}, ...],
     "latent_shape": [C, H, W], "cond": "labels", "num_classes": K}
index.json (embeddings, e.g. text):
    {"shards": [...], "latent_shape": [C, T, H, W], "cond": "embedding", "cond_shape": [L, D]}

Each shard i holds (N_i = shards[i]["num_samples"]):
    latents   [N_i, *latent_shape]   floating (float32 / bfloat16 / float16); [C, H, W] or video [C, T, H, W]
    labels    [N_i]                  integer, values in [0, K)         (cond == "labels")
    cond      [N_i, *cond_shape]     floating                          (cond == "embedding")
    text_len  [N_i]                  integer, optional: real tokens of each zero-padded text embedding
All floating values must be finite. Null condition: class id K; for embeddings the negative-prompt
embedding <dir>/negative.safetensors (tensor 'cond' [*cond_shape]), else all zeros: CFG's negative branch
(teacher sampling and the DMD2 teacher score) uses it, as Wan's recipes do.

`ShardDataset(path)` reads index.json and every shard's header at open time (`shard_index.py`: files inside
<dir>, each listed once; names, shapes, dtypes, whole files; no tensor data), then reads only the rows a batch
asks for (`safetensors_rows.py`), keeping at most `max_open` shards open (least recently used closed first).
Every read is of the shard version checked at start-up: a shard deleted, replaced, truncated, grown or modified
since (checked with one fstat per shard a batch touches, in whichever process reads it, a DataLoader worker
included) is a DataError naming the shard and what changed. Batches come back in the stored
dtype (a bf16 set stays bf16 until it reaches the device: `loader.py` casts there); their values are checked
as they are read. Host memory is the batch, independent of the set's size. `load_shards(path)` is the
in-memory reader (every shard read whole, float32), kept as the reference and baseline of the streaming one.
"""
import math
import os
from collections import OrderedDict
from typing import List, Tuple

import torch
from torch.utils.data import get_worker_info

from dmd2_mega.errors import DataError
from .dataset import ImageDataset, LatentDataset
from .safetensors_rows import FileChanged, RowFile
from .shard_index import INDEX, NEGATIVE, bad_values, check_shard, cond_key, read_index, read_negative


def _empty(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised batch; in a DataLoader worker, in shared memory, so that handing it to the training
    process costs no copy (what torch's default collate does for the tensors it stacks)."""
    if get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    numel = math.prod(shape)
    storage = torch.UntypedStorage._new_shared(numel * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


class ShardDataset(LatentDataset):
    """A validated shard directory read by rows (see the module docstring for the format)."""

    def __init__(self, path: str, max_open: int = 8):
        index = read_index(path)
        self.path, self.max_open, self.key = path, max(1, max_open), cond_key(index)
        self.files = [os.path.join(path, e["file"]) for e in index["shards"]]
        checked = [check_shard(path, e, index) for e in index["shards"]]
        self.headers = [tensors for tensors, _ in checked]
        self.stamps = [stamp for _, stamp in checked]  # the version of each shard every later read must find
        sizes = torch.tensor([e["num_samples"] for e in index["shards"]], dtype=torch.int64)
        self.ends = sizes.cumsum(0)
        self.starts = self.ends - sizes
        labels = index["cond"] == "labels"
        self.dtypes = {name: self._common_dtype(name) for name in ("latents", self.key)}
        self._set_shapes(index["latent_shape"][0], index["latent_shape"][1:], index["num_classes"] if labels else None,
                         None if labels else index["cond_shape"], os.path.join(path, INDEX), index.get("cond_parts"))
        if not labels and os.path.exists(os.path.join(path, NEGATIVE)):
            self.set_negative(read_negative(path, self.negative_shape), os.path.join(path, NEGATIVE))
        elif not labels:
            self.null_note = (f"the zero embedding ({path} holds no {NEGATIVE}; launch/prepare_data.py writes one "
                              f"from --negative-prompt)")
        self._open: "OrderedDict[int, RowFile]" = OrderedDict()

    def _common_dtype(self, name: str) -> torch.dtype:
        dtype = self.headers[0][name].dtype
        for h in self.headers[1:]:
            dtype = torch.promote_types(dtype, h[name].dtype)
        return torch.int64 if name == "labels" else dtype

    def __len__(self) -> int:
        return int(self.ends[-1])

    def _file(self, s: int) -> RowFile:
        """Shard s open, and still the version checked at start-up."""
        f = self._open.get(s)
        if f is None:
            if len(self._open) >= self.max_open:
                self._open.popitem(last=False)[1].close()
            f = self._open[s] = RowFile(self.files[s], self.headers[s], self.stamps[s])  # checked as it opens
        else:
            self._open.move_to_end(s)  # most recently used last
            f.check()
        return f

    def _read_shard(self, s: int, local: torch.Tensor, names: Tuple[str, ...], outs: List[torch.Tensor],
                    pos: torch.Tensor) -> None:
        """Rows `local` of shard s into outs[...][pos]; a shard changed since start-up, or unreadable, is a
        DataError naming it."""
        try:
            f = self._file(s)
            for name, out in zip(names, outs):
                if f.tensors[name].dtype == out.dtype:  # straight into the batch
                    f.read_into(name, local, out, pos)
                else:  # a shard stored in another dtype than the set's common one
                    out[pos] = f.read(name, local).to(out.dtype)
        except FileChanged as e:
            self._drop(s)
            raise DataError(f"{self.files[s]}: the shard changed during the run: {e}; restore it as it was (or "
                            f"rebuild the set) and resume from the last checkpoint") from None
        except OSError as e:
            self._drop(s)
            raise DataError(f"{self.files[s]}: cannot read the shard ({e})") from None

    def _drop(self, s: int) -> None:
        f = self._open.pop(s, None)
        if f is not None:
            f.close()

    def _rows(self, indices: torch.Tensor, names: Tuple[str, ...]) -> List[torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= len(self)):
            raise DataError(f"{self.source}: sample index out of range [0, {len(self)})")
        shard = torch.searchsorted(self.ends, idx, right=True)
        local = idx - self.starts[shard]
        outs = [_empty((idx.numel(), *self.headers[0][n].shape[1:]), self.dtypes.get(n, torch.int64)) for n in names]
        for s in torch.unique(shard).tolist():  # one pass per shard the batch touches
            pos = (shard == s).nonzero().squeeze(1)
            self._read_shard(s, local[pos], names, outs, pos)
        for name, out in zip(names, outs):
            bad = bad_values(out, name, self.num_classes if name == "labels" else None)
            if bad is not None:
                i, what = bad
                raise DataError(f"{self.files[int(shard[i])]}: {what} in sample {int(local[i])}")
        return outs

    def get_batch(self, indices: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """indices int64 [n] -> (latents [n, C, *spatial] in the stored dtype, labels int64 [n] or embeddings
        [n, *cond_shape] in the stored dtype)."""
        x, cond = self._rows(indices, ("latents", self.key))
        return x, cond

    def get_cond(self, indices: torch.Tensor) -> torch.Tensor:
        """Only the conditions of `get_batch` (a DMD2 student without a GAN head never reads the latents)."""
        return self._rows(indices, (self.key,))[0]

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].close()

    def __getstate__(self):  # DataLoader workers open their own files
        state = dict(self.__dict__)
        state["_open"] = OrderedDict()
        return state

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def load_shards(path: str) -> ImageDataset:
    """The whole shard set in memory (latents float32, labels int64, embeddings float32): the reference and
    baseline of `ShardDataset`, for sets that fit in host memory."""
    ds = ShardDataset(path, max_open=1)
    x, cond = ds.get_batch(torch.arange(len(ds)))
    out = ImageDataset(x, cond, ds.num_classes, ds.cond_shape, source=ds.source, cond_parts=ds.cond_parts)
    out.negative, out.null_note = ds.negative, ds.null_note
    ds.close()
    return out
