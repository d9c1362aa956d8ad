"""3-D rotary position tables of the Wan family: frames / height / width split of the head dim.

A head of width d rotates d / 2 interleaved pairs (2j, 2j + 1). Wan gives the height and the width
2 * (d // 6) channels each and the frames the rest (d = 128: 44 / 42 / 42), so pairs
[0, t/2) take the frame index, the next h/2 the row, the last w/2 the column. Within an axis of
width a, pair k turns at the angle pos * theta^(-2k / a). For a latent grid of F x H x W tokens
(frame-major, then row, then column, the patch embedding's order) the tables are

    cos, sin [F * H * W, d / 2] float32   (angles in float64, rounded once, as diffusers does)

and the rotation itself is `dmd2_kernels.qk_norm_rope`'s (fused with the q / k RMSNorm).
"""
from __future__ import annotations

import functools

import torch


def axis_dims(head_dim: int) -> tuple[int, int, int]:
    """Channels of the (frames, height, width) axes of one head."""
    hw = 2 * (head_dim // 6)
    return head_dim - 2 * hw, hw, hw


def _angles(n: int, dim: int, theta: float, first: int = 0) -> torch.Tensor:
    """[n, dim / 2] float64: position p in [first, first + n), pair k -> p * theta^(-2k / dim)."""
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return torch.outer(torch.arange(first, first + n, dtype=torch.float64), inv)


@functools.lru_cache(maxsize=16)
def rope_tables(grid: tuple[int, int, int], head_dim: int, theta: float = 10000.0,
                device: torch.device = torch.device("cpu"), first_frame: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [F * H * W, head_dim / 2] float32 on `device` for a token grid (F, H, W) whose frames are
    first_frame .. first_frame + F - 1 (a streamed chunk's place in its video); cached per grid, offset and
    device, so a forward neither recomputes them nor copies them to the GPU (16 MB at Wan 480p)."""
    f, h, w = grid
    dt, dh, dw = axis_dims(head_dim)
    at, ah, aw = _angles(f, dt, theta, first_frame), _angles(h, dh, theta), _angles(w, dw, theta)
    ang = torch.cat([at[:, None, None].expand(f, h, w, -1), ah[None, :, None].expand(f, h, w, -1),
                     aw[None, None, :].expand(f, h, w, -1)], dim=-1).reshape(f * h * w, head_dim // 2)
    return ang.cos().float().to(device), ang.sin().float().to(device)
