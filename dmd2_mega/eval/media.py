"""Samples as media files: MP4 (H.264) and GIF clips, PNG images, decoded from latents with a VAE when needed.

Pixels in [-1, 1] -> uint8 round((x + 1) * 127.5), clipped to [0, 255], NaN -> 0 (`grid.save_grid`'s rule);
C == 1 grey, C == 3 RGB. A clip is [T, C, H, W]; a batch is our sample layout, videos [N, C, T, H, W] or
images [N, C, H, W].
Viewable size: a frame whose shorter side is under MIN_SIDE = 128 px is upscaled (nearest neighbour) by the
integer factor u = ceil(MIN_SIDE / min(H, W)), so an 8x8 digit becomes 128x128 and a 16x16 clip 128x128;
larger frames keep their size (u = 1). The MP4 then pads an odd height or width by repeating the last row /
column (H.264 in yuv420p needs even sides): a [T, 3, 129, 131] clip is written 130x132.
    write_mp4   H.264, yuv420p, CRF 18, +faststart, through imageio-ffmpeg's ffmpeg binary (ConfigError naming
                the package when it is missing: never a silent fallback to another format)
    write_gif   Pillow, looping; identical consecutive frames merge into one (the play time is kept)
    write_png   one image through `grid.save_grid`
Every file is written atomically: a temporary name beside the target, then `os.replace` (`files/atomic.py`:
`atomic_path` for ffmpeg, which needs a real path, `atomic_write` for the rest). Files are named by prompt
(`Prompts.names()`: `<i>_<slug>`) or by index (`000`, `001`, ...) when there are no prompts.

`EvalMedia` is what the in-training eval (`--eval-interval`) writes: it reads `--eval-prompts` and loads
`--vae` (main rank only) at start-up, checks both against the data before any training, and at each eval
writes `<dir>/media/iter_XXXXXXX/<name>.mp4 + .gif` (videos) or `.png` (images) for the first MEDIA_SAMPLES
samples (every prompt with --eval-prompts), returning a `MediaFiles` whose GIFs / PNGs the logger sends to
TensorBoard.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image

from dmd2_mega.files.atomic import atomic_path, atomic_write
from dmd2_mega.data.moving_digits import frames_of_spec
from dmd2_mega.data.prompts import Prompts, read_prompts
from dmd2_mega.errors import ConfigError, DataError, EvalInputError
from dmd2_mega.eval.grid import save_grid
from dmd2_mega.prep.vae import LatentVAE, VAESpec
from dmd2_mega.sampling import eval_conditions

MIN_SIDE = 128
"""Frames with a shorter side below this are upscaled to at least it (nearest neighbour, integer factor)."""
VIDEO_FPS = 16
"""Frame rate of decoded video (Wan's)."""
PIXEL_FPS = 4
"""Frame rate of the embedded pixel clips (`--data moving-digits`: 4 frames play in one second)."""
MEDIA_SAMPLES = 8
"""Eval samples written as media when there are no --eval-prompts."""
PIXEL_DATA = ("digits", "moving-digits")
"""The --data values that hold pixels (and 'moving-digits:T'; shard directories hold latents)."""
CRF = 18
"""x264's constant rate factor for the MP4s (18: visually lossless)."""


def holds_pixels(data: Optional[str]) -> bool:
    """Whether a --data value holds pixels in [-1, 1] (which need no VAE), not latents."""
    return data in PIXEL_DATA or frames_of_spec(data) is not None


def viewable_scale(height: int, width: int) -> int:
    """The nearest-neighbour upscale factor of the module docstring."""
    return max(1, math.ceil(MIN_SIDE / max(1, min(height, width))))


def to_uint8(x) -> np.ndarray:
    """Pixels in [-1, 1] (any shape) -> uint8 (`grid.save_grid`'s rule)."""
    x = x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float32)
    return np.clip(np.round((np.nan_to_num(x, nan=-1.0) + 1.0) * 127.5), 0, 255).astype(np.uint8)


def clip_frames(clip, even: bool = False) -> np.ndarray:
    """A clip [T, C, H, W] (C = 1 or 3) in [-1, 1] -> viewable uint8 frames [T, H', W', C]: upscaled by
    `viewable_scale`, and with even sides (the last row / column repeated) when `even`."""
    shape = tuple(clip.shape)
    if len(shape) != 4 or shape[1] not in (1, 3) or shape[0] < 1:
        raise EvalInputError(f"a clip must be [T, C, H, W] with T >= 1 and C = 1 (grey) or 3 (RGB), got shape "
                             f"{list(shape)}")
    u = viewable_scale(shape[2], shape[3])
    frames = to_uint8(clip).transpose(0, 2, 3, 1)
    if u > 1:
        frames = frames.repeat(u, axis=1).repeat(u, axis=2)
    if even:
        frames = np.pad(frames, ((0, 0), (0, frames.shape[1] % 2), (0, frames.shape[2] % 2), (0, 0)), mode="edge")
    return np.ascontiguousarray(frames)


def require_ffmpeg(why: str) -> None:
    """ConfigError naming imageio-ffmpeg (and `why`: the flag or output that asks for MP4) when it is missing."""
    try:
        import imageio_ffmpeg
        imageio_ffmpeg.get_ffmpeg_exe()
    except (ImportError, RuntimeError) as e:
        raise ConfigError(f"{why} writes MP4 (H.264) video, which needs the imageio-ffmpeg package and its ffmpeg "
                          f"binary: not available ({e}); pip install imageio-ffmpeg") from e


def write_mp4(path: str, clip, fps: float = VIDEO_FPS) -> str:
    """A clip [T, C, H, W] in [-1, 1] -> H.264 MP4 (yuv420p) at `path`; returns the path."""
    require_ffmpeg(f"writing {path}")
    import imageio_ffmpeg
    frames = clip_frames(clip, even=True)
    path = os.fspath(path)
    with atomic_path(path) as tmp:
        writer = imageio_ffmpeg.write_frames(
            tmp, (frames.shape[2], frames.shape[1]), pix_fmt_in="gray" if frames.shape[3] == 1 else "rgb24",
            pix_fmt_out="yuv420p", fps=fps, quality=None, codec="libx264", macro_block_size=1,
            output_params=["-crf", str(CRF), "-movflags", "+faststart", "-f", "mp4"])
        writer.send(None)
        for frame in frames:
            writer.send(frame)
        writer.close()
    return path


def write_gif(path: str, clip, fps: float = VIDEO_FPS) -> str:
    """A clip [T, C, H, W] in [-1, 1] -> looping GIF at `path` (grey frames exact, RGB quantised); returns it."""
    frames = clip_frames(clip)
    images = [Image.fromarray(f[..., 0] if f.shape[2] == 1 else f) for f in frames]
    path = os.fspath(path)
    atomic_write(path, lambda f: images[0].save(f, format="GIF", save_all=True, append_images=images[1:],
                                                duration=round(1000 / fps), loop=0))
    return path


def write_png(path: str, image) -> str:
    """An image [C, H, W] in [-1, 1] -> PNG at `path`, upscaled by `viewable_scale`; returns the path."""
    if len(tuple(image.shape)) != 3:
        raise EvalInputError(f"write_png: an image must be [C, H, W], got shape {list(image.shape)}")
    return save_grid(image[None], None, path, upscale=viewable_scale(*image.shape[1:]))


def media_names(n: int, names: Optional[Sequence[str]] = None) -> List[str]:
    """n unique file names: by index (`000`, ...), or sample i named names[i % P] (`_<i // P>` appended when
    there are more samples than names)."""
    if not names:
        return [f"{i:03d}" for i in range(n)]
    p = len(names)
    return [names[i % p] + (f"_{i // p}" if n > p else "") for i in range(n)]


@dataclass
class MediaFiles:
    """The media one call wrote: its directory and {name: the file TensorBoard shows} (a video's GIF, an image's
    PNG). Printed, it is the directory."""
    root: str
    shown: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return self.root


def write_sample(root: str, name: str, pixels, fps: float = VIDEO_FPS) -> str:
    """One sample in [-1, 1]: a video [C, T, H, W] -> <root>/<name>.mp4 + .gif, an image [C, H, W] ->
    <root>/<name>.png. Returns the path TensorBoard shows (the GIF or the PNG)."""
    base = os.path.join(root, name)
    if pixels.dim() == 4:
        clip = pixels.transpose(0, 1)
        write_mp4(base + ".mp4", clip, fps)
        return write_gif(base + ".gif", clip, fps)
    return write_png(base + ".png", pixels)


def check_vae(vae, latent_shape: Sequence[int], where: str = "--vae") -> None:
    """ConfigError starting with `where` (the flag and its value) unless the VAE decodes latents [C, *spatial] of
    this shape: its latent channels are C, and it is a video VAE for [C, T, H, W], an image VAE for [C, H, W]."""
    c, spatial = int(latent_shape[0]), tuple(latent_shape[1:])
    if vae.latent_channels != c:
        raise ConfigError(f"{where}: the VAE's latents have {vae.latent_channels} channels, but the model's have {c} "
                          f"(latent shape {[c, *spatial]}); expected the VAE the data was encoded with")
    video = len(spatial) == 3
    if vae.video != video:
        raise ConfigError(f"{where}: a {vae.kind!r} VAE cannot decode the model's "
                          f"{'video' if video else 'image'} latents {[c, *spatial]}; expected a "
                          f"{'Wan video (AutoencoderKLWan)' if video else 'image (AutoencoderKL)'} VAE")


def decoded(samples: torch.Tensor, vae: Optional[LatentVAE] = None) -> Iterator[torch.Tensor]:
    """Per sample of a batch: its pixels [C, (T,) H, W] float32 on the CPU; latents decoded one at a time by
    `vae` (normalised latents -> [-1, 1]) when given, else the samples are pixels already."""
    for i in range(samples.shape[0]):
        x = samples[i:i + 1]
        yield (x if vae is None else vae.decode(x))[0].float().cpu()


def write_samples(root: str, samples: torch.Tensor, names: Sequence[str], vae: Optional[LatentVAE] = None,
                  fps: Optional[float] = None, keep: int = 0) -> Tuple[MediaFiles, List[torch.Tensor]]:
    """`write_sample` for samples[:len(names)], decoded by `vae` when given (fps default: VIDEO_FPS for decoded
    video, PIXEL_FPS for pixel clips). Returns the files and the pixels of the first `keep` images (for a grid;
    none for video)."""
    fps = fps or (VIDEO_FPS if vae is not None else PIXEL_FPS)
    files, kept = MediaFiles(root), []
    for i, (name, pixels) in enumerate(zip(names, decoded(samples[:len(names)], vae))):
        files.shown[name] = write_sample(root, name, pixels, fps)
        if pixels.dim() == 3 and i < keep:
            kept.append(pixels)
    return files, kept


class EvalMedia:
    """The in-training eval's media (module docstring), for `--data` `data` of `dataset`'s shape.

    `prompts`: the --eval-prompts file (None: the eval samples `eval_conditions(dataset, --eval-num-samples)`);
    `enabled`: whether media are written (pixel data, or latents with --vae); `vae`: loaded on the CPU on the
    main rank only, moved to `device` for each eval's decode and back."""

    def __init__(self, data: str, dataset, eval_prompts: Optional[str], vae: Optional[str], is_main: bool,
                 device: torch.device):
        self.device = device
        shape = (dataset.channels, *dataset.spatial)
        self.prompts: Optional[Prompts] = None
        if eval_prompts:
            if dataset.cond_shape is None:
                raise DataError(f"--eval-prompts {eval_prompts}: --data {data} is class-conditional; prompt "
                                f"embeddings need text-conditioned data")
            self.prompts = read_prompts(eval_prompts, dataset.cond_shape, flag="--eval-prompts")
        if vae and holds_pixels(data):
            raise ConfigError(f"--vae {vae}: --data {data} holds pixels, not latents; there is nothing to decode")
        self.enabled = bool(vae) or holds_pixels(data)
        if self.enabled and len(shape) == 4:
            require_ffmpeg("--eval-interval (video samples)")
        if vae:  # every rank checks the config; only the main rank loads the weights
            check_vae(VAESpec.from_folder(vae, "--vae"), shape, f"--vae {vae}")
        self.vae = LatentVAE.from_folder(vae, flag="--vae") if vae and is_main else None

    def conditions(self, dataset, n: int) -> torch.Tensor:
        """The eval's conditions: the prompts' embeddings (float32), else `eval_conditions(dataset, n)`."""
        return self.prompts.cond.float() if self.prompts is not None else eval_conditions(dataset, n)

    def negative(self, n: int) -> Optional[torch.Tensor]:
        """CFG's negative branch for the n eval samples: the prompts file's negative, or None (the model's)."""
        if self.prompts is None or self.prompts.negative is None:
            return None
        return self.prompts.negative.float().expand(n, *self.prompts.negative.shape)

    def names(self, n: int) -> List[str]:
        return self.prompts.names() if self.prompts is not None else media_names(min(n, MEDIA_SAMPLES))

    @contextlib.contextmanager
    def _decoder(self) -> Iterator[Optional[LatentVAE]]:
        if self.vae is None:
            yield None
            return
        model = self.vae.model.to(self.device)
        try:
            yield LatentVAE(self.vae.spec, model, self.device, self.vae.dtype)
        finally:
            model.to("cpu")

    def write(self, samples: torch.Tensor, out_dir: Optional[str], iteration: int) -> Optional[MediaFiles]:
        """Main rank: the media of one eval's samples in <out_dir>/media/iter_XXXXXXX/, or None when there are none."""
        if not (self.enabled and out_dir):
            return None
        with self._decoder() as vae:
            return write_samples(os.path.join(out_dir, "media", f"iter_{iteration:07d}"), samples,
                                 self.names(samples.shape[0]), vae)[0]
