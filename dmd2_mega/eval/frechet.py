"""Frechet distance between Gaussians fitted to two feature sets.

For features a [Na, D] and b [Nb, D] with means mu_a, mu_b and (unbiased) covariances S_a, S_b:

    FD = ||mu_a - mu_b||^2 + tr(S_a) + tr(S_b) - 2 tr((S_a S_b)^{1/2})

All maths is float64. tr((S_a S_b)^{1/2}) is computed in the symmetric form
tr((A S_b A)^{1/2}) with A = S_a^{1/2}: A S_b A is similar to S_a S_b, symmetric positive
semi-definite, so its eigenvalues come from `eigh`, are clipped at 0 (rounding) and their square
roots summed (eigenvalues within eigh's rounding of 0 count as 0). No complex matrix square root,
and singular covariances (N <= D, dead ReLU features) need no eps offset.
"""
from __future__ import annotations

import numpy as np
import torch

from dmd2_mega.errors import EvalInputError


def _as_feats(x, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().double().numpy()
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise EvalInputError(f"{name} must be a 2-D feature array [N, D], got shape {x.shape}")
    if x.shape[0] < 2:
        raise EvalInputError(f"{name} needs at least 2 rows to fit a covariance, got {x.shape[0]}")
    if not np.isfinite(x).all():
        raise EvalInputError(f"{name} contains NaN or inf")
    return x


def _clean_eigs(w: np.ndarray) -> np.ndarray:
    """Eigenvalues of a PSD matrix with rounding noise (|w| <= D * eps * max|w|, eigh's accuracy)
    set to 0: their square roots would otherwise add ~sqrt(eps) each for singular covariances."""
    tol = len(w) * np.finfo(np.float64).eps * max(np.abs(w).max(initial=0.0), 1e-300)
    return np.where(w > tol, w, 0.0)


def _sym_sqrt(s: np.ndarray) -> np.ndarray:
    """Square root of a symmetric PSD matrix via eigh."""
    w, v = np.linalg.eigh((s + s.T) / 2)
    return (v * np.sqrt(_clean_eigs(w))) @ v.T


def gaussian_frechet(mu_a, cov_a, mu_b, cov_b) -> float:
    """FD between N(mu_a, cov_a) and N(mu_b, cov_b); covariances symmetric PSD [D, D]."""
    mu_a, mu_b = np.asarray(mu_a, np.float64), np.asarray(mu_b, np.float64)
    cov_a, cov_b = np.asarray(cov_a, np.float64), np.asarray(cov_b, np.float64)
    root_a = _sym_sqrt(cov_a)
    m = root_a @ cov_b @ root_a
    tr_covmean = np.sqrt(_clean_eigs(np.linalg.eigvalsh((m + m.T) / 2))).sum()
    diff = mu_a - mu_b
    fd = diff @ diff + np.trace(cov_a) + np.trace(cov_b) - 2.0 * tr_covmean
    # FD >= 0 exactly; a value below 0 is float rounding of two equal distributions.
    return float(max(fd, 0.0))


def frechet_distance(feats_a, feats_b) -> float:
    """Frechet distance between Gaussian fits of feats_a [Na, D] and feats_b [Nb, D] (numpy or torch)."""
    a = _as_feats(feats_a, "feats_a")
    b = _as_feats(feats_b, "feats_b")
    if a.shape[1] != b.shape[1]:
        raise EvalInputError(f"feature dims differ: feats_a has D={a.shape[1]}, feats_b has D={b.shape[1]}")
    return gaussian_frechet(a.mean(0), np.cov(a, rowvar=False).reshape(a.shape[1], a.shape[1]),
                            b.mean(0), np.cov(b, rowvar=False).reshape(b.shape[1], b.shape[1]))
