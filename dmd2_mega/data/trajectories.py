"""Teacher trajectories as training data: the shard directory `launch/prepare_trajectories.py` writes, read by the
methods that regress a student onto its teacher's ODE (`methods/causal_init/`).

It is a shard set (`shards.py`: index.json, latents = the teacher's x0, cond, negative.safetensors) whose index.json
adds {"trajectory": {"sigmas": [the student grid], ...}} and whose shards add
    trajectory  [n, N, *latent_shape]   x on the teacher's Euler path at each of the N student sigmas
    noise       [n, *latent_shape]      the path's start
`TrajectoryDataset(path)` reads it row by row like any shard set; its samples are the paths: `get_batch(idx)` ->
(paths [n, N + 1, *latent_shape] = the N grid states then x0, conditions). `latent_shape` stays the clip's, so the
models are built for clips.
"""
from __future__ import annotations

import json
import os
from typing import Tuple

import torch

from dmd2_mega.errors import DataError
from .shard_index import INDEX
from .shards import ShardDataset

TRAJECTORY = "trajectory"


class TrajectoryDataset(ShardDataset):
    """A trajectory shard set (module docstring); `sigmas`: the student grid its paths were stored at."""

    def __init__(self, path: str, max_open: int = 8):
        super().__init__(path, max_open)
        with open(os.path.join(path, INDEX)) as f:
            meta = json.load(f).get(TRAJECTORY)
        if not isinstance(meta, dict) or not meta.get("sigmas"):
            raise DataError(f"--data {path} holds no teacher trajectories (its {INDEX} has no '{TRAJECTORY}' entry); "
                            f"make them with launch/prepare_trajectories.py")
        self.meta, self.sigmas = meta, [float(s) for s in meta["sigmas"]]
        want = [len(self.sigmas), self.channels, *self.spatial]
        for where, h in zip(self.files, self.headers):
            got = h.get(TRAJECTORY)
            if got is None or list(got.shape[1:]) != want or not got.dtype.is_floating_point:
                raise DataError(f"{where}: expected a floating tensor '{TRAJECTORY}' [n, {', '.join(map(str, want))}] "
                                f"(the path at the {len(self.sigmas)} student sigmas), found "
                                f"{list(got.shape) if got is not None else 'none'}")
        self.dtypes[TRAJECTORY] = self._common_dtype(TRAJECTORY)

    def get_batch(self, indices: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """indices [n] -> (paths [n, N + 1, *latent_shape]: the grid states, then x0; conditions)."""
        path, x0, cond = self._rows(indices, (TRAJECTORY, "latents", self.key))
        return torch.cat([path, x0.to(path.dtype)[:, None]], dim=1), cond
