"""FID of generated samples against reference statistics, in the papers' convention, streamed over batches and ranks.

Pixels -> network input. Samples x in [-1, 1], [B, C, H, W] with C = 3 (RGB) or 1 (grey, repeated to 3
channels, as StyleGAN3's metrics do), become uint8 [B, 3, H, W]:
    "round" (default)  u = floor(127.5 x + 128) clamped to [0, 255], i.e. round(127.5 (x + 1)) with halves up
                       (EDM's and StyleGAN's `(x * 127.5 + 128).clamp(0, 255).to(torch.uint8)`)
    "floor"            u = floor(127.5 (x + 1)) clamped (ADM's sample script and tianweiy/DMD2's ImageNet
                       eval: `((x + 1) * 127.5).clamp(0, 255).to(torch.uint8)`, a cast that truncates)
NaN pixels count as -1 (black). The Inception network (`eval.inception`) resizes to 299 inside.

Feature statistics. Each rank sums over the samples it made, in float64 on the device,
    n,   s = sum_i f_i [D],   S = sum_i f_i f_i^T [D, D]
(`FeatureStats.update`); partial statistics add (`merge`, and `all_reduce` over ranks: one SUM of n, s, S).
At the end
    mu = s / n,    Sigma = (S - n mu mu^T) / (n - 1)
which is np.mean / np.cov(features, rowvar=False) (unbiased, as the ADM evaluator, clean-fid and tianweiy/DMD2;
StyleGAN3 divides by n), without ever holding the [N, D] features: memory is O(batch x D + D^2).

FID = ||mu - mu_ref||^2 + tr(Sigma + Sigma_ref - 2 (Sigma Sigma_ref)^{1/2}), `eval.frechet.gaussian_frechet`
(float64, eigh-based).

Reference statistics: an .npz with `mu` [D] and `sigma` [D, D] (ADM's VIRTUAL_imagenet256_labeled.npz, the
reference batches DMD2 reports against, and clean-fid's stats files); other arrays in it (ADM's `arr_0` images,
`mu_s` / `sigma_s`) are never read. `save_stats` writes the same keys. `load_ref_stats` refuses, naming the file
and what is wrong, anything else: a directory, a cut or non-zip file, missing keys, other shapes, NaN / inf, or a
sigma that is not symmetric positive semi-definite within its dtype's rounding (`stats_problem`), which would
otherwise give a meaningless FID (a negative-definite sigma printed FID 0.0000).

Sharding: of P ranks, rank r takes sample indices r, r + P, r + 2P, ... (`shard_indices`); with noise keyed by
sample index (`sampling.keyed_noise`) the statistics do not depend on P or on the batch size, up to the
rounding of float32 forwards at other batch sizes and the order of the float64 sums.
"""
from __future__ import annotations

import os
import time
import zipfile
import zlib
from typing import Callable, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from dmd2_mega.files.atomic import atomic_write
from dmd2_mega.errors import ConfigError, EvalInputError

ROUNDING = ("round", "floor")


def shard_indices(n: int, rank: int, size: int) -> range:
    """The sample indices of `rank` out of `size`: rank, rank + size, ... below n."""
    return range(rank, n, size)


def pixels_to_uint8(x: torch.Tensor, rounding: str = "round") -> torch.Tensor:
    """Images [B, C, H, W] in [-1, 1] (C = 1 or 3) -> uint8 [B, 3, H, W] by the module docstring's rule."""
    if x.dim() != 4 or x.shape[1] not in (1, 3):
        raise EvalInputError(f"images must be [B, C, H, W] with C = 1 (grey) or 3 (RGB), got {list(x.shape)}")
    if rounding not in ROUNDING:
        raise EvalInputError(f"rounding must be one of {ROUNDING}, got {rounding!r}")
    x = torch.nan_to_num(x.float(), nan=-1.0)
    u = x * 127.5 + 128.0 if rounding == "round" else (x + 1.0) * 127.5
    u = u.clamp_(0, 255).floor_().to(torch.uint8)
    return u.expand(-1, 3, -1, -1).contiguous() if u.shape[1] == 1 else u


class FeatureStats:
    """Streaming float64 sums of features [B, D]: count n, s = sum f [D], S = sum f f^T [D, D] (module docstring)."""

    def __init__(self, width: int, device="cpu"):
        self.width = int(width)
        self.count = 0
        self.total = torch.zeros(self.width, dtype=torch.float64, device=device)
        self.outer = torch.zeros((self.width, self.width), dtype=torch.float64, device=device)

    def update(self, feats: torch.Tensor) -> None:
        """Add the rows of feats [B, D] (any float dtype; summed in float64)."""
        if feats.dim() != 2 or feats.shape[1] != self.width:
            raise EvalInputError(f"features must be [B, {self.width}], got {list(feats.shape)}")
        f = feats.detach().to(self.total.device, torch.float64)
        self.count += f.shape[0]
        self.total += f.sum(0)
        self.outer += f.T @ f

    def merge(self, other: "FeatureStats") -> "FeatureStats":
        """Add another partial statistic of the same width (another batch set or rank) into this one."""
        if other.width != self.width:
            raise EvalInputError(f"cannot merge feature statistics of width {other.width} into width {self.width}")
        self.count += other.count
        self.total += other.total.to(self.total.device)
        self.outer += other.outer.to(self.outer.device)
        return self

    def all_reduce(self, group=None) -> "FeatureStats":
        """Sum n, s and S over the ranks of `group` (collective; a no-op in a world of one)."""
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            flat = torch.cat([torch.tensor([float(self.count)], dtype=torch.float64, device=self.total.device),
                              self.total, self.outer.reshape(-1)])
            dist.all_reduce(flat, group=group)
            self.count = int(round(flat[0].item()))
            self.total.copy_(flat[1:1 + self.width])
            self.outer.copy_(flat[1 + self.width:].view(self.width, self.width))
        return self

    def mean_cov(self) -> Tuple[np.ndarray, np.ndarray]:
        """(mu [D], unbiased Sigma [D, D]) float64 numpy; needs n >= 2."""
        if self.count < 2:
            raise EvalInputError(f"a covariance needs at least 2 samples, got {self.count}")
        n = self.count
        mu = self.total.cpu().numpy() / n
        sigma = (self.outer.cpu().numpy() - n * np.outer(mu, mu)) / (n - 1)
        return mu, (sigma + sigma.T) / 2  # exactly symmetric (the float64 sums are, up to rounding)


def load_ref_stats(path: str, flag: str = "--ref-stats") -> Tuple[np.ndarray, np.ndarray]:
    """(mu [D], sigma [D, D]) float64 from an .npz; ConfigError naming the flag, the file and what is wrong when it
    is missing, a directory, not an .npz (a truncated archive, a bare .npy), lacks `mu` / `sigma`, or they are not
    Gaussian statistics (`stats_problem`)."""
    expected = "an .npz with 'mu' [D] and 'sigma' [D, D], e.g. ADM's VIRTUAL_imagenet256_labeled.npz"
    if not path or not os.path.exists(path):
        raise ConfigError(f"{flag} {path} does not exist (expected {expected})")
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a directory; expected a file: {expected}")
    try:
        with open(path, "rb") as f:  # np.load would hand back a bare .npy as an array, not an archive
            magic = f.read(6)
        if not magic.startswith(b"PK\x03\x04"):
            what = ("a single .npy array" if magic == b"\x93NUMPY" else
                    "not a zip archive (empty, cut or another format)")
            raise ConfigError(f"{flag} {path} is {what}; expected {expected}")
        with np.load(path, allow_pickle=False) as z:
            keys = list(z.keys())
            missing = [k for k in ("mu", "sigma") if k not in keys]
            if missing:
                raise ConfigError(f"{flag} {path} has no {' / '.join(repr(k) for k in missing)} array (found keys "
                                  f"{keys}); expected 'mu' [D] and 'sigma' [D, D] (ADM / clean-fid convention)")
            mu, sigma = z["mu"], z["sigma"]
    except ConfigError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise ConfigError(f"{flag} {path} is not a readable .npz (truncated or corrupt? "
                          f"{type(e).__name__}: {' '.join(str(e).split())[:200]})") from e
    problem = stats_problem(mu, sigma)
    if problem is not None:
        raise ConfigError(f"{flag} {path}: {problem}")
    return np.asarray(mu, np.float64), np.asarray(sigma, np.float64)


def stats_problem(mu: np.ndarray, sigma: np.ndarray) -> Optional[str]:
    """What keeps (mu, sigma) from being a Gaussian's statistics, in one phrase, or None. In order: real dtypes;
    shapes [D] and [D, D], D >= 1; finite values; sigma symmetric and positive semi-definite up to rounding:
        max |sigma - sigma^T| <= tol * max |sigma|,   min eig(sigma) >= -tol * max |eig(sigma)|,
        tol = D eps_64 + sqrt(D) eps,
    with eps the machine epsilon of the stored dtype (storing a PSD matrix rounds each entry by eps / 2, which moves
    its eigenvalues by about sqrt(D) eps max |sigma|) and D eps_64 the float64 arithmetic (eigh's backward error).
    Without the check a negative-definite sigma makes FID's trace terms negative and the FID prints as 0."""
    for name, x in (("mu", mu), ("sigma", sigma)):
        if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
            return f"'{name}' has dtype {x.dtype}; expected real numbers"
    if mu.ndim != 1 or mu.shape[0] < 1 or sigma.shape != (mu.shape[0], mu.shape[0]):
        return (f"'mu' has shape {list(mu.shape)} and 'sigma' {list(sigma.shape)}; expected [D] and [D, D] "
                f"with D >= 1")
    for name, x in (("mu", mu), ("sigma", sigma)):
        bad = ~np.isfinite(x)
        if bad.any():
            first = [int(i) for i in np.argwhere(bad)[0]]
            return f"'{name}' holds {int(bad.sum())} NaN / inf value(s) (the first at {first})"
    d = mu.shape[0]
    eps = np.finfo(sigma.dtype).eps if np.issubdtype(sigma.dtype, np.floating) else 0.0
    tol = d * np.finfo(np.float64).eps + np.sqrt(d) * eps
    s = sigma.astype(np.float64)
    asym = np.abs(s - s.T)
    scale = np.abs(s).max()
    if asym.max() > tol * scale:
        i, j = (int(k) for k in np.unravel_index(asym.argmax(), asym.shape))
        return (f"'sigma' is not symmetric: sigma[{i}, {j}] = {s[i, j]:.6g} but sigma[{j}, {i}] = {s[j, i]:.6g} "
                f"(|difference| {asym.max():.3g} > {tol:.2g} x max |sigma| for {d}-dim {sigma.dtype}); a covariance "
                f"is symmetric")
    w = np.linalg.eigvalsh((s + s.T) / 2)
    if w[0] < -tol * np.abs(w).max():
        return (f"'sigma' is not positive semi-definite: its smallest eigenvalue is {w[0]:.6g} (largest "
                f"{w[-1]:.6g}; rounding allows down to -{tol:.2g} x {np.abs(w).max():.6g} for {d}-dim "
                f"{sigma.dtype}); a covariance has no negative eigenvalues")
    return None


def check_ref_width(mu: np.ndarray, width: int, ref_path: str, net_path: str) -> None:
    """ConfigError naming both files when the reference's D is not the network's feature width."""
    if mu.shape[0] != width:
        raise ConfigError(f"--ref-stats {ref_path} holds {mu.shape[0]}-dim statistics ('mu', 'sigma'), but "
                          f"--inception-weights {net_path} gives {width}-dim features; both must come from the "
                          f"same network (inception-2015-12-05: 2048)")


def save_stats(path: str, mu: np.ndarray, sigma: np.ndarray, count: int) -> None:
    """Write `mu`, `sigma` (float64, the reference convention) and `num_samples` to an .npz, atomically."""
    atomic_write(path, lambda f: np.savez(f, mu=mu, sigma=sigma, num_samples=np.int64(count)))


def stream_stats(indices: Sequence[int], batch_size: int, make_images: Callable[[Sequence[int]], torch.Tensor],
                 features: Callable[[torch.Tensor], torch.Tensor], width: int, device="cpu",
                 progress: Optional[Callable[[int, float], None]] = None) -> FeatureStats:
    """This rank's statistics: for each batch of `indices` (`batch_size` at a time) images = make_images(batch)
    (uint8 [B, 3, H, W]) and stats.update(features(images)); `progress(done, seconds)` after every batch."""
    stats = FeatureStats(width, device)
    start = time.time()
    for lo in range(0, len(indices), batch_size):
        batch = indices[lo:lo + batch_size]
        stats.update(features(make_images(batch)))
        if progress is not None:
            progress(min(lo + batch_size, len(indices)), time.time() - start)
    return stats
