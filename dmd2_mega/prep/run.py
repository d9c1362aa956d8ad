"""The two jobs of `launch/prepare_data.py`: `prepare(cfg)` (media + captions, or class folders -> shards) and
`prepare_prompts(cfg)` (a prompts file -> the `--eval-prompts` safetensors file).

`prepare` under torchrun: every rank runs the same checks (flags against the VAE config, the captions file or
the class folders) before any model loads. Rank 0 then takes --out's lock (the trainers' `dir_lock`, released
when `prepare` returns) before it looks at the shards already there: a second run on the same --out stops with
one line naming the first (torchrun then stops its other ranks) instead of encoding the same shards and
deleting the first's temporary files. The process-group rendezvous (gloo: only a barrier is needed) orders
every rank's "look at --out" before any "write to --out". Rank r encodes the shards k with k % world == r
that have no file yet: clips are read by `--workers` DataLoader processes (uint8 frames), then per shard
    latents  = vae.encode(pixels [B, 3, (T,) H, W], posterior mean, or mean + std * eps with eps drawn
               from a generator seeded by (--seed, clip index): the same on any number of ranks)
    cond, text_len = text.encode(captions, --max-text-len)      (captions; with an image-to-video pipeline cond
                                                                 is flat: text, CLIP, image latent: image.py), or
    labels   = the class folder indices                         (--labels-from-folders: ADM's centre crop,
                                                                 an AutoencoderKL, no text encoder)
and written whole (writer.py). After a barrier rank 0 writes negative.safetensors or classes.json, index.json,
report.json and prints the summary. Models run on cuda:LOCAL_RANK in bf16 (fp32 on CPU) unless
--compute-dtype says otherwise; values are stored in --dtype.
"""
import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import List, Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

from dmd2_mega.data.dataset import parts_record
from dmd2_mega.data.prompts import write_prompts
from dmd2_mega.files.dir_lock import DirLock
from dmd2_mega.errors import ConfigError, DataError

from .clips import Clip, read_captions
from .folders import list_class_folders
from .image import ImageConditioner, flat_condition, load_first_frames, read_image_prompts, resolve_image
from .media import load_clip, to_pixels
from .text import DEFAULT_NEGATIVE, TextEncoder, resolve_folders
from .vae import LatentVAE, VAESpec
from .writer import (build_report, finished_shards, plan_shards, read_shard_headers, write_classes, write_index,
                     write_negative, write_report, write_shard)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEFAULT_SIZE = {"wan": (81, 480, 832), "kl": (1, 256, 256)}  # WanPipeline's defaults; DiT's 256 x 256


@dataclass
class PrepConfig:
    """The flags of launch/prepare_data.py (docs/prepare_data.md)."""
    text_encoder: Optional[str] = None      # required unless labels_from_folders
    tokenizer: Optional[str] = None
    vae: Optional[str] = None
    media: Optional[str] = None
    captions: Optional[str] = None
    out: Optional[str] = None
    prompts: Optional[str] = None           # --prompts-only: one prompt per line
    frames: Optional[int] = None            # None: 81 for Wan, 1 for an image VAE
    height: Optional[int] = None            # None: 480 (Wan) / 256
    width: Optional[int] = None             # None: 832 (Wan) / 256
    fps: Optional[float] = None             # None: frames evenly over the whole clip
    max_text_len: int = 512
    negative_prompt: str = DEFAULT_NEGATIVE
    shard_size: int = 64
    dtype: str = "bf16"                     # stored latents / cond
    compute_dtype: str = "auto"             # bf16 on GPU, fp32 on CPU
    sample_posterior: bool = False
    seed: int = 0
    batch_size: int = 1                     # clips per VAE call
    text_batch_size: int = 16               # captions per text-encoder call
    workers: int = 4                        # DataLoader processes reading media
    device: str = "auto"                    # cuda:LOCAL_RANK when CUDA is there, else cpu
    skip_bad_captions: bool = False         # leave malformed caption rows out (listed in report.json)
    labels_from_folders: bool = False       # media = DIR/<class>/<image>: class labels, ADM crop, no text
    num_classes: Optional[int] = None       # labels_from_folders: the class folders expected
    pipeline: Optional[str] = None          # the pipeline folder: its model_index.json / transformer decide I2V
    image_condition: Optional[str] = None   # "concat" / "first-frame" without an I2V pipeline folder (image.py)
    image_encoder: Optional[str] = None     # CLIPVisionModel folder (Wan 2.1 I2V); default <pipeline>/image_encoder
    image_processor: Optional[str] = None   # its CLIPImageProcessor; default the sibling image_processor/
    images: Optional[str] = None            # --prompts-only: CSV / JSONL of image path + caption per eval condition

    def check(self) -> None:
        """Value checks that need no file (ConfigError naming the flag)."""
        for flag, v, lo in (("--max-text-len", self.max_text_len, 1), ("--shard-size", self.shard_size, 1),
                            ("--batch-size", self.batch_size, 1), ("--text-batch-size", self.text_batch_size, 1),
                            ("--workers", self.workers, 0), ("--seed", self.seed, 0)):
            if not isinstance(v, int) or v < lo:
                raise ConfigError(f"{flag} {v}: expected an integer >= {lo}")
        if self.fps is not None and not self.fps > 0:
            raise ConfigError(f"--fps {self.fps}: expected a frame rate > 0")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype}: expected one of {sorted(DTYPES)}")
        if self.compute_dtype not in ("auto", *DTYPES):
            raise ConfigError(f"--compute-dtype {self.compute_dtype}: expected auto, bf16 or fp32")
        if not self.labels_from_folders:
            if self.num_classes is not None:
                raise ConfigError(f"--num-classes {self.num_classes} goes with --labels-from-folders")
            return
        given = [flag for flag, v in (("--captions", self.captions), ("--text-encoder", self.text_encoder),
                                      ("--tokenizer", self.tokenizer), ("--prompts", self.prompts), ("--fps", self.fps),
                                      ("--image-condition", self.image_condition), ("--images", self.images),
                                      ("--image-encoder", self.image_encoder),
                                      ("--image-processor", self.image_processor))
                 if v is not None] + (["--negative-prompt"] if self.negative_prompt != DEFAULT_NEGATIVE else []) + \
            (["--skip-bad-captions"] if self.skip_bad_captions else [])
        if given:
            raise ConfigError(f"{' '.join(given)} with --labels-from-folders: the labels come from the class folders "
                              f"(no captions, no text encoder, images only); drop {' '.join(given)}")
        if self.frames not in (None, 1):
            raise ConfigError(f"--frames {self.frames}: --labels-from-folders reads images (1 frame)")
        if self.height is not None and self.width is not None and self.height != self.width:
            raise ConfigError(f"--height {self.height} --width {self.width}: --labels-from-folders makes square "
                              f"crops (ADM's center_crop_arr); give one size")
        if self.num_classes is not None and (not isinstance(self.num_classes, int) or self.num_classes < 1):
            raise ConfigError(f"--num-classes {self.num_classes}: expected an integer >= 1")


def _device_and_dtype(cfg: PrepConfig):
    if cfg.device == "auto":
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(cfg.device)
        except RuntimeError as e:
            raise ConfigError(f"--device {cfg.device}: not a torch device ({e})") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {cfg.device}: CUDA is not available here")
        torch.cuda.set_device(device)
    if cfg.compute_dtype == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, DTYPES[cfg.compute_dtype]


def _encode_texts(text: TextEncoder, captions: List[str], cfg: PrepConfig):
    """(cond [n, L, D] in --dtype, text_len [n]) in --text-batch-size chunks."""
    if not captions:
        return torch.zeros(0, cfg.max_text_len, text.dim, dtype=DTYPES[cfg.dtype]), torch.zeros(0, dtype=torch.long)
    parts = [text.encode(captions[i:i + cfg.text_batch_size], cfg.max_text_len)
             for i in range(0, len(captions), cfg.text_batch_size)]
    return torch.cat([p[0] for p in parts]).to("cpu", DTYPES[cfg.dtype]), torch.cat([p[1] for p in parts])


class _ClipReader(torch.utils.data.Dataset):
    """Item i of the rank's to-do list -> (i, uint8 frames or None, skip reason), in a DataLoader worker."""

    def __init__(self, items, media: str, size: tuple, fps: Optional[float], crop: str):
        self.items, self.media, self.size, self.fps, self.crop = items, media, size, fps, crop

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        _, clip = self.items[i]
        frames, reason = load_clip(os.path.join(self.media, clip.path), *self.size, fps=self.fps, crop=self.crop)
        return i, frames, reason


def _noise(indices: List[int], shape: tuple, seed: int) -> torch.Tensor:
    """Standard normal [B, *shape]: one generator per clip, seeded by (seed, global clip index)."""
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(seed * 1_000_003 + i))
                        for i in indices])


def _world():
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _size(cfg: PrepConfig, kind: str) -> tuple:
    """(frames, height, width): the flags, else the VAE kind's defaults; with --labels-from-folders one of --height /
    --width sets both (square crops)."""
    height, width = cfg.height, cfg.width
    if cfg.labels_from_folders:
        height = width = height if height is not None else width
    return tuple(d if v is None else v for v, d in zip((cfg.frames, height, width), DEFAULT_SIZE[kind]))


def prepare(cfg: PrepConfig) -> Optional[dict]:
    """Media + captions, or class folders -> shards under cfg.out (module docstring). Returns the report on rank 0,
    else None."""
    cfg.check()
    labels = cfg.labels_from_folders
    for flag, v in (("--vae", cfg.vae), ("--media", cfg.media), ("--captions", cfg.captions), ("--out", cfg.out)):
        if not v and not (labels and flag == "--captions"):
            raise ConfigError(f"{flag} is required (or --pipeline DIR for --vae)" if flag == "--vae"
                              else f"{flag} is required")
    spec = VAESpec.from_folder(cfg.vae)
    if labels and spec.video:
        raise ConfigError(f"--vae {cfg.vae}: {spec.class_name} is a video VAE; --labels-from-folders encodes images "
                          f"with an AutoencoderKL (e.g. stabilityai/sd-vae-ft-ema)")
    frames, height, width = _size(cfg, spec.kind)
    latent_shape = spec.latent_shape(frames, height, width)
    text_config = None if labels else resolve_folders(cfg.text_encoder, cfg.tokenizer)[2]
    image = None if labels else resolve_image(cfg.pipeline, cfg.image_condition, cfg.image_encoder,
                                              cfg.image_processor, spec)
    if not os.path.isdir(cfg.media):
        what = "one subfolder of images per class" if labels else "the folder the captions' paths are relative to"
        raise DataError(f"--media {cfg.media}: not a directory ({what})")
    if os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise ConfigError(f"--out {cfg.out}: exists and is not a directory")
    settings = {"vae": spec.class_name, "latent_shape": list(latent_shape), "frames": frames, "height": height,
                "width": width, "fps": cfg.fps, "dtype": cfg.dtype, "sample_posterior": cfg.sample_posterior,
                "seed": cfg.seed if cfg.sample_posterior else None, "shard_size": cfg.shard_size}
    if labels:
        folders = list_class_folders(cfg.media, cfg.num_classes)
        clips, classes = folders.clips, folders.classes
        cond = {"cond": "labels", "num_classes": len(classes)}
        settings.update(crop="adm", num_classes=len(classes))
        listed = f"{len(clips)} images in {len(classes)} class folders ({folders.left_out} other files left out)"
        cond_line, source = f"labels in [0, {len(classes)})", {}
    else:
        captions, classes = read_captions(cfg.captions, spec.video, frames, cfg.skip_bad_captions), None
        clips = captions.clips
        cond_shape = [cfg.max_text_len, text_config["d_model"]]
        cond = {"cond": "embedding", "cond_shape": cond_shape}
        cond_line = f"cond {cond_shape}"
        if image is not None:  # one flat condition per clip (image.py); settings name the form and parts
            parts = parts_record(image.parts(cond_shape, latent_shape))
            cond = {"cond": "embedding", "cond_shape": [sum(math.prod(p) for _, p in parts)], "cond_parts": parts}
            settings.update(image_condition=image.form, cond_parts=parts)
            cond_line = f"cond {cond['cond_shape']} = {' + '.join(f'{n} {p}' for n, p in parts)}; {image.describe()}"
        settings.update(cond_shape=cond["cond_shape"], text_encoder=text_config["model_type"])
        source = {"caption_rows_read": captions.rows, "caption_rows_skipped": captions.bad}
        bad = f", {len(captions.bad)} malformed left out (--skip-bad-captions)" if captions.bad else ""
        listed = f"{len(clips)} clips ({captions.rows} caption rows read{bad})"
    chunks = plan_shards(clips, cfg.shard_size)

    rank, world = _world()
    lock = DirLock(cfg.out, "--out", DataError) if rank == 0 else None  # before this run looks at --out
    try:
        if lock is not None and lock.note:
            print(lock.note, flush=True)
        done = finished_shards(cfg.out, settings, chunks)
        os.makedirs(cfg.out, exist_ok=True)
        if world > 1:  # the rendezvous is the barrier between every rank's look at --out and any write
            dist.init_process_group("gloo", timeout=timedelta(hours=24))
        device, compute = _device_and_dtype(cfg)
        mine = [k for k in range(len(chunks)) if k % world == rank and k not in done]
        if rank == 0:
            print(f"prepare_data: {listed} in {len(chunks)} shards of {cfg.shard_size}, {len(done)} already "
                  f"written; {world} rank(s) on {device} ({compute}); latents {list(latent_shape)}, {cond_line}",
                  flush=True)
        text = None
        if not labels and (mine or rank == 0):
            text = TextEncoder.from_folder(cfg.text_encoder, cfg.tokenizer, device, compute)
        vae = LatentVAE.from_folder(cfg.vae, device, compute) if mine else None
        images = ImageConditioner.load(image, vae) if image is not None and mine else None
        start = time.perf_counter()
        if mine:
            _encode_shards(cfg, chunks, mine, vae, text, images, latent_shape, (frames, height, width), settings,
                           rank, world)
        if world > 1:
            dist.barrier()
        if rank != 0:
            return None
        negative = None if labels else _encode_texts(text, [cfg.negative_prompt], cfg)[0][0]
        heads = read_shard_headers(cfg.out, len(chunks))
        report = build_report(heads, done, time.perf_counter() - start, world, source)
        index_error = None
        try:
            write_index(cfg.out, heads, latent_shape, cond)
            if labels:
                write_classes(cfg.out, classes)
            else:
                write_negative(cfg.out, negative)
        except DataError as e:  # nothing encodable: still leave the report behind, then fail
            index_error = e
        print(write_report(cfg.out, report), flush=True)
        if index_error is not None:
            raise index_error
        return report
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
        if lock is not None:
            lock.release()


def _cond_tensors(cfg: PrepConfig, text: Optional[TextEncoder], clips: List[Clip],
                  image: Optional[torch.Tensor]) -> dict:
    """The condition tensors of a shard's written clips: labels int64 [n] (class folders), or the caption
    embeddings cond [n, L, D] (with `image`, the clips' image parts [n, k]: cond [n, L * D + k]) and text_len int64
    [n]."""
    if cfg.labels_from_folders:
        return {"labels": torch.tensor([c.label for c in clips], dtype=torch.long)}
    cond, text_len = _encode_texts(text, [c.caption for c in clips], cfg)
    return {"cond": cond if image is None else flat_condition(cond, image), "text_len": text_len}


def _encode_shards(cfg, chunks, mine, vae, text, images, latent_shape, size, settings, rank, world) -> None:
    items = [item for k in mine for item in chunks[k]]
    crop = "adm" if cfg.labels_from_folders else "cover"
    loader = torch.utils.data.DataLoader(_ClipReader(items, cfg.media, size, cfg.fps, crop), batch_size=None,
                                         num_workers=cfg.workers)
    ends = {}  # the item position that closes each shard -> shard id
    pos = 0
    for k in mine:
        pos += len(chunks[k])
        ends[pos - 1] = k
    video = vae.video
    latents, extras, written, kept, skipped, batch = [], [], [], [], [], []

    def flush():
        if batch:
            pixels = torch.stack([b[1] for b in batch])
            noise = _noise([b[0] for b in batch], latent_shape, cfg.seed) if cfg.sample_posterior else None
            latents.append(vae.encode(pixels, noise).to("cpu", DTYPES[cfg.dtype]))
            if images is not None:  # the image parts of the batch's first frames (uint8 [B, H, W, 3])
                extras.append(images.encode(torch.stack([b[2] for b in batch]), size[0]).to(DTYPES[cfg.dtype]))
            batch.clear()

    bar = tqdm(total=len(items), unit="clip", disable=rank != 0, desc=f"rank 0/{world}", dynamic_ncols=True)
    with bar:
        for i, frames, reason in loader:
            index, clip = items[i]
            if frames is None:
                skipped.append((clip.path, reason))
            else:
                batch.append((index, to_pixels(frames.to(vae.device), video), frames[0]))  # uint8 over the bus
                written.append(clip.path)
                kept.append(clip)
                if len(batch) == cfg.batch_size:
                    flush()
            if i in ends:
                flush()
                k = ends[i]
                lat = torch.cat(latents) if latents else torch.zeros(0, *latent_shape, dtype=DTYPES[cfg.dtype])
                image = None if images is None else torch.cat(extras) if extras else \
                    torch.zeros(0, images.spec.numel(latent_shape), dtype=DTYPES[cfg.dtype])
                write_shard(cfg.out, k, {"latents": lat, **_cond_tensors(cfg, text, kept, image)}, settings,
                            chunks[k], written, skipped)
                latents, extras, written, kept, skipped = [], [], [], [], []
                bar.set_postfix_str(f"shard {k}")
            bar.update(1)


def read_prompt_lines(path: str) -> List[str]:
    """The stripped non-blank lines of the text file `path`. A binary file (a NUL byte, or not UTF-8: an
    eval-prompts .safetensors, an image) is a DataError saying what --prompts takes."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
        nul = next((n for n, line in enumerate(lines, 1) if "\0" in line), None)
        why = None if nul is None else f"a NUL byte on line {nul}"
    except UnicodeDecodeError as e:
        why = f"not UTF-8: {e}"
    if why:
        raise DataError(f"--prompts {path}: not a text file ({why}); --prompts takes a text file, one prompt a line "
                        f"(sample.py --prompts takes the .safetensors file that --prompts-only writes)")
    return [line.strip() for line in lines if line.strip()]


def prepare_prompts(cfg: PrepConfig) -> Optional[List[str]]:
    """`--prompts-only`: one prompt per non-blank line of cfg.prompts -> write_prompts(cfg.out, ...) with the
    negative prompt (with --images: `prepare_image_prompts`). Rank 0 only. Returns the prompts."""
    cfg.check()
    if cfg.images:
        return prepare_image_prompts(cfg)
    if not cfg.prompts or not os.path.isfile(cfg.prompts):
        raise DataError(f"--prompts {cfg.prompts}: no such file (one prompt per line)")
    if not cfg.out or os.path.isdir(cfg.out):
        raise ConfigError(f"--out {cfg.out}: with --prompts-only, the safetensors file to write")
    resolve_folders(cfg.text_encoder, cfg.tokenizer)
    image = resolve_image(cfg.pipeline, cfg.image_condition, cfg.image_encoder, cfg.image_processor, None)
    if image is not None:
        raise ConfigError(f"--prompts {cfg.prompts}: the model reads an image with each prompt ({image.describe()}); "
                          f"give --images FILE (a CSV / JSONL of image 'path' and 'caption' per eval condition)")
    texts = read_prompt_lines(cfg.prompts)
    if not texts:
        raise DataError(f"--prompts {cfg.prompts}: no prompts (one per non-blank line)")
    if _world()[0] != 0:
        return None
    device, compute = _device_and_dtype(cfg)
    text = TextEncoder.from_folder(cfg.text_encoder, cfg.tokenizer, device, compute)
    cond, _ = _encode_texts(text, texts, cfg)
    negative = _encode_texts(text, [cfg.negative_prompt], cfg)[0][0]
    write_prompts(cfg.out, cond, texts, negative)
    print(f"prepare_data: {len(texts)} prompts -> {cfg.out} (cond {list(cond.shape)}, {cfg.dtype}, with the "
          f"negative prompt)", flush=True)
    return texts


def prepare_image_prompts(cfg: PrepConfig) -> Optional[List[str]]:
    """`--prompts-only --images FILE`: each row's image and prompt -> the flat image-to-video condition [P, N]
    (image.py; the image read at --height x --width, its latent for --frames), the text-only negative [L, D], the
    parts and image paths in the metadata: write_prompts(cfg.out, ...). Rank 0 only. Returns the prompts."""
    if cfg.prompts:
        raise ConfigError(f"--prompts {cfg.prompts} with --images {cfg.images}: give one (--images rows carry their "
                          f"prompts)")
    if not cfg.out or os.path.isdir(cfg.out):
        raise ConfigError(f"--out {cfg.out}: with --prompts-only, the safetensors file to write")
    rows = read_image_prompts(cfg.images, cfg.media)
    if not cfg.vae:
        raise ConfigError("--vae is required with --images (or --pipeline DIR): the image latent")
    spec = VAESpec.from_folder(cfg.vae)
    frames, height, width = _size(cfg, spec.kind)
    latent_shape = spec.latent_shape(frames, height, width)
    text_config = resolve_folders(cfg.text_encoder, cfg.tokenizer)[2]
    image = resolve_image(cfg.pipeline, cfg.image_condition, cfg.image_encoder, cfg.image_processor, spec)
    if image is None:
        raise ConfigError(f"--images {cfg.images}: goes with an image-to-video pipeline (--pipeline DIR of a "
                          f"WanImageToVideoPipeline) or --image-condition {{concat,first-frame}}")
    parts = image.parts((cfg.max_text_len, text_config["d_model"]), latent_shape)
    if _world()[0] != 0:
        return None
    first = load_first_frames(rows, height, width, f"--images {cfg.images}")
    device, compute = _device_and_dtype(cfg)
    text = TextEncoder.from_folder(cfg.text_encoder, cfg.tokenizer, device, compute)
    conditioner = ImageConditioner.load(image, LatentVAE.from_folder(cfg.vae, device, compute))
    texts = [r.caption for r in rows]
    cond, _ = _encode_texts(text, texts, cfg)
    extra = torch.cat([conditioner.encode(first[i:i + cfg.batch_size], frames)
                       for i in range(0, len(rows), cfg.batch_size)])
    cond = flat_condition(cond, extra.to(DTYPES[cfg.dtype]))
    negative = _encode_texts(text, [cfg.negative_prompt], cfg)[0][0]
    write_prompts(cfg.out, cond, texts, negative, cond_parts=parts, images=[r.path for r in rows])
    print(f"prepare_data: {len(texts)} image prompts -> {cfg.out} (cond {list(cond.shape)} = "
          f"{' + '.join(f'{n} {list(p)}' for n, p in parts)}, {cfg.dtype}, images {height} x {width} for "
          f"{frames} frames, with the text-only negative prompt {list(negative.shape)}); {image.describe()}",
          flush=True)
    return texts
