"""Reading one clip: a video / GIF / image file -> uint8 frames [T, H, W, 3], sampled, resized, cropped.

    frame indices  evenly over the clip: round(linspace(0, n - 1, T))            (default), or
                   at `fps` from the start: floor(i * source_fps / fps), i < T   (when fps is given)
    resize         crop "cover": bilinear with antialiasing by s = max(H / h, W / w), so the frame covers
                   H x W (the shorter side when the aspect ratios agree), then a centre crop to H x W
                   crop "adm" (one image, H == W == S; --labels-from-folders): ADM's / DiT's `center_crop_arr`
                   on the RGB image (w, h): while min(w, h) >= 2S, (w, h) <- (w // 2, h // 2) with Pillow's BOX;
                   then (round(w * S / m), round(h * S / m)), m = min(w, h), with Pillow's BICUBIC; then the
                   S x S crop at top (h - S) // 2, left (w - S) // 2
    pixels         x / 127.5 - 1 in [-1, 1]: [3, T, H, W] for a video VAE, [3, H, W] for an image VAE
Videos (.mp4 .webm .mov .mkv .avi) are decoded by imageio-ffmpeg's ffmpeg (rgb24, only up to the last
needed frame), GIFs and images by Pillow. `load_clip` never raises for a bad file: it returns the frames,
or None and the reason (unreadable, too short), which the writer lists in report.json.
"""
import math
import os
from typing import Callable, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

VIDEO_EXT = (".mp4", ".webm", ".mov", ".mkv", ".avi", ".gif")
IMAGE_EXT = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".ppm", ".pgm", ".tif", ".tiff")  # torchvision's + webp
CROPS = ("cover", "adm")


class _TooShort(Exception):
    """Internal: a readable clip with fewer frames than asked (turned into a skip reason by load_clip)."""


def frame_indices(n: int, frames: int, source_fps: Optional[float] = None,
                  fps: Optional[float] = None) -> torch.Tensor:
    """The `frames` frame indices [frames] int64 to keep of an n-frame clip (module docstring);
    raises _TooShort when the clip cannot give them."""
    if fps is None:
        if n < frames:
            raise _TooShort(f"too short: {n} frames, --frames {frames} needs {frames}")
        return torch.linspace(0, n - 1, frames, dtype=torch.float64).round().long()
    if not source_fps or not math.isfinite(source_fps) or source_fps <= 0:
        raise _TooShort("unknown frame rate, needed by --fps")
    idx = torch.floor(torch.arange(frames, dtype=torch.float64) * (source_fps / fps)).long()
    if int(idx[-1]) >= n:
        raise _TooShort(f"too short: {n} frames at {source_fps:g} fps, --frames {frames} at --fps {fps:g} "
                        f"needs {int(idx[-1]) + 1}")
    return idx


def resize_crop(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [T, h, w, 3] -> uint8 [T, height, width, 3]: scale to cover, then centre crop."""
    _, h, w, _ = frames.shape
    s = max(height / h, width / w)
    nh, nw = max(height, round(h * s)), max(width, round(w * s))
    x = frames.permute(0, 3, 1, 2)
    if (nh, nw) != (h, w):
        x = F.interpolate(x.float(), size=(nh, nw), mode="bilinear", align_corners=False, antialias=True)
        x = x.round().clamp(0, 255).to(torch.uint8)
    top, left = (nh - height) // 2, (nw - width) // 2
    return x[:, :, top:top + height, left:left + width].permute(0, 2, 3, 1).contiguous()


def adm_center_crop(image, size: int) -> np.ndarray:
    """A Pillow RGB image -> uint8 [size, size, 3]: crop "adm" of the module docstring (halvings, bicubic, crop)."""
    from PIL import Image
    while min(image.size) >= 2 * size:
        image = image.resize((image.width // 2, image.height // 2), resample=Image.Resampling.BOX)
    scale = size / min(image.size)
    image = image.resize((round(image.width * scale), round(image.height * scale)), resample=Image.Resampling.BICUBIC)
    top, left = (image.height - size) // 2, (image.width - size) // 2
    return np.array(image)[top:top + size, left:left + size].copy()


def to_pixels(frames: torch.Tensor, video: bool) -> torch.Tensor:
    """uint8 [T, H, W, 3] -> float32 in [-1, 1]: [3, T, H, W] (video) or [3, H, W] (image, T == 1)."""
    x = frames.permute(3, 0, 1, 2).float() / 127.5 - 1.0
    return x if video else x[:, 0]


def _read_ffmpeg(path: str, pick: Callable[[int, Optional[float]], torch.Tensor]) -> np.ndarray:
    import imageio_ffmpeg
    n, _ = imageio_ffmpeg.count_frames_and_secs(path)
    reader = imageio_ffmpeg.read_frames(path, pix_fmt="rgb24")
    try:
        meta = next(reader)
        w, h = meta["size"]
        idx = pick(n, meta.get("fps"))
        want, last, got = set(idx.tolist()), int(idx.max()), {}
        for i, buf in enumerate(reader):
            if i in want:
                got[i] = np.frombuffer(buf, dtype=np.uint8).reshape(h, w, 3)
            if i >= last:
                break
    finally:
        reader.close()
    if len(got) < len(want):
        raise _TooShort(f"too short: decoding stopped after {len(got)} of the {len(want)} frames to keep "
                        f"(the container said {n})")
    return np.stack([got[i] for i in idx.tolist()])


def _read_pillow(path: str, pick: Callable[[int, Optional[float]], torch.Tensor]) -> np.ndarray:
    from PIL import Image
    with Image.open(path) as im:
        n = getattr(im, "n_frames", 1)
        duration_ms = im.info.get("duration")
        idx = pick(n, 1000.0 / duration_ms if duration_ms else None)
        out = []
        for i in idx.tolist():
            im.seek(i)
            out.append(np.asarray(im.convert("RGB")))
    return np.stack(out)


def _read_adm(path: str, size: int) -> np.ndarray:
    """uint8 [1, size, size, 3]: the first frame as RGB (torchvision's ImageFolder loader), crop "adm"."""
    from PIL import Image
    with Image.open(path) as im:
        rgb = im.convert("RGB")
    return adm_center_crop(rgb, size)[None]


def load_clip(path: str, frames: int, height: int, width: int, fps: Optional[float] = None,
              crop: str = "cover") -> Tuple[Optional[torch.Tensor], str]:
    """(uint8 [frames, height, width, 3], "") or (None, reason) for a missing, unreadable or too-short file.
    `crop` is a resize of the module docstring; "adm" takes one square frame of an image."""
    if crop not in CROPS or (crop == "adm" and (frames != 1 or height != width)):
        raise ValueError(f"load_clip: crop {crop!r} with {frames} frames of {height} x {width}; expected one of "
                         f"{CROPS}, and 1 square frame for 'adm'")
    if not os.path.isfile(path):
        return None, "missing file"

    def pick(n: int, source_fps: Optional[float]) -> torch.Tensor:
        return frame_indices(n, frames, source_fps, fps)

    ext = os.path.splitext(path)[1].lower()
    try:
        if crop == "adm":
            return torch.from_numpy(_read_adm(path, height)), ""
        raw = _read_pillow(path, pick) if ext in (".gif",) + IMAGE_EXT else _read_ffmpeg(path, pick)
        return resize_crop(torch.from_numpy(raw), height, width), ""
    except _TooShort as e:
        return None, str(e)
    except Exception as e:  # every decoder error (ffmpeg, Pillow, a bad header) makes the file unreadable
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        msg = lines[-1][:200] if lines else ""  # ffmpeg's log ends with its verdict
        return None, f"unreadable ({type(e).__name__}: {msg})"
