"""Megatron-style global-batch sampler: which sample indices each data-parallel rank reads.

G = --global-batch-size, m = --micro-batch-size, D = data-parallel size, M = G / (m * D).
Epoch e reads the permutation  perm_e = randperm(N, generator seeded with hash(seed, e)),
identical on every rank; iterations per epoch = N // G (the incomplete last global batch is
dropped). Iteration t of epoch e takes the global batch  B = perm_e[t*G : (t+1)*G]  and splits
it into G / m micro-batches; global micro-batch j in [0, G/m) is  B[j*m : (j+1)*m].
Rank r takes the contiguous block j in [r*M, (r+1)*M).

The caller seeds per-micro-batch noise with j, so a DP=1 run and a DP=2 run draw the same samples
with the same noise. The position is `consumed_samples` (global count, Megatron's name):
epoch = consumed // (iters_per_epoch * G), iteration-in-epoch = (consumed mod that) // G.
"""
from typing import List, Tuple

import numpy as np
import torch

from dmd2_mega.errors import DataError


class GlobalBatchSampler:
    """`next_iteration()` -> this rank's M pairs (global micro-batch index j, int64 indices [m])."""

    def __init__(self, num_samples: int, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, consumed_samples: int = 0):
        G, m, D = global_batch_size, micro_batch_size, dp_size
        if m < 1 or G < 1 or D < 1:
            raise DataError(f"--global-batch-size ({G}), --micro-batch-size ({m}) and data-parallel "
                            f"size ({D}) must be >= 1")
        if G % (m * D):
            raise DataError(f"--global-batch-size ({G}) must be a multiple of --micro-batch-size x "
                            f"data-parallel size ({m} x {D} = {m * D})")
        if G > num_samples:
            raise DataError(f"--global-batch-size ({G}) exceeds the dataset size ({num_samples} "
                            f"samples); lower --global-batch-size or use more data")
        if not 0 <= dp_rank < D:
            raise DataError(f"dp_rank must be in [0, {D}), got {dp_rank}")
        if seed < 0:
            raise DataError(f"--seed must be >= 0, got {seed}")
        self.num_samples, self.global_batch_size, self.micro_batch_size = num_samples, G, m
        self.dp_rank, self.dp_size, self.seed = dp_rank, D, seed
        self.micro_per_rank = G // (m * D)
        self.iters_per_epoch = num_samples // G
        self.consumed_samples = consumed_samples
        self._perm_epoch, self._perm = -1, None

    @property
    def epoch(self) -> int:
        return self.consumed_samples // (self.iters_per_epoch * self.global_batch_size)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            # torch's CPU generator (mt19937) keeps only the low 32 bits of its seed, so (seed, epoch)
            # is hashed into 32 bits with NumPy's SeedSequence (a stable, documented mixer).
            mixed = int(np.random.SeedSequence([self.seed, epoch]).generate_state(1)[0])
            g = torch.Generator().manual_seed(mixed)
            self._perm, self._perm_epoch = torch.randperm(self.num_samples, generator=g), epoch
        return self._perm

    def global_batch(self) -> torch.Tensor:
        """The next iteration's G indices (all ranks), without advancing."""
        G = self.global_batch_size
        t = (self.consumed_samples % (self.iters_per_epoch * G)) // G
        return self._permutation(self.epoch)[t * G:(t + 1) * G]

    def next_iteration(self) -> List[Tuple[int, torch.Tensor]]:
        """This rank's micro-batches of the next global batch; advances consumed_samples by G."""
        if self.consumed_samples % self.global_batch_size:
            raise DataError(f"consumed_samples ({self.consumed_samples}) is not a multiple of "
                            f"--global-batch-size ({self.global_batch_size})")
        batch, m, M = self.global_batch(), self.micro_batch_size, self.micro_per_rank
        first = self.dp_rank * M
        out = [(j, batch[j * m:(j + 1) * m].clone()) for j in range(first, first + M)]
        self.consumed_samples += self.global_batch_size
        return out

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed,
                "num_samples": self.num_samples, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Resume exactly; the dataset size, seed and global batch must match the saved run."""
        for key, flag in (("num_samples", "--data (dataset size)"), ("seed", "--seed"),
                          ("global_batch_size", "--global-batch-size")):
            if key in state and state[key] != getattr(self, key):
                raise DataError(f"cannot resume the data position: {flag} was {state[key]} in the "
                                f"checkpoint, now {getattr(self, key)}")
        self.consumed_samples = int(state["consumed_samples"])
