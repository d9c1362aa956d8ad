"""The two jobs of `launch/prepare_data.py`: `prepare(cfg)` (media + captions -> shards) and
`prepare_prompts(cfg)` (a prompts file -> the `--eval-prompts` safetensors file).

`prepare` under torchrun: every rank runs the same checks (flags against the VAE config, the captions file,
shards already under --out) before any model loads; the process-group rendezvous (gloo: only a barrier is
needed) then orders "look at --out" before "write to --out". Rank r encodes the shards k with k % world == r
that have no file yet: clips are read by `--workers` DataLoader processes (uint8 frames), then per shard
    latents  = vae.encode(pixels [B, 3, (T,) H, W], posterior mean, or mean + std * eps with eps drawn
               from a generator seeded by (--seed, clip index): the same on any number of ranks)
    cond, text_len = text.encode(captions, --max-text-len)
and written whole (writer.py). After a barrier rank 0 writes index.json, negative.safetensors, report.json
and prints the summary. Models run on cuda:LOCAL_RANK in bf16 (fp32 on CPU) unless --compute-dtype says
otherwise; values are stored in --dtype.
"""
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import List, Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

from dmd2_mega.data.prompts import write_prompts
from dmd2_mega.errors import ConfigError, DataError

from .clips import read_captions
from .media import load_clip, to_pixels
from .text import DEFAULT_NEGATIVE, TextEncoder, resolve_folders
from .vae import LatentVAE, VAESpec
from .writer import (build_report, finished_shards, plan_shards, read_shard_headers, write_index,
                     write_negative, write_report, write_shard)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEFAULT_SIZE = {"wan": (81, 480, 832), "kl": (1, 256, 256)}  # WanPipeline's defaults; DiT's 256 x 256


@dataclass
class PrepConfig:
    """The flags of launch/prepare_data.py (docs/prepare_data.md)."""
    text_encoder: str
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

    def __init__(self, items, media: str, size: tuple, fps: Optional[float]):
        self.items, self.media, self.size, self.fps = items, media, size, fps

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        _, clip = self.items[i]
        frames, reason = load_clip(os.path.join(self.media, clip.path), *self.size, fps=self.fps)
        return i, frames, reason


def _noise(indices: List[int], shape: tuple, seed: int) -> torch.Tensor:
    """Standard normal [B, *shape]: one generator per clip, seeded by (seed, global clip index)."""
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(seed * 1_000_003 + i))
                        for i in indices])


def _world():
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def prepare(cfg: PrepConfig) -> Optional[dict]:
    """Media + captions -> shards under cfg.out (module docstring). Returns the report on rank 0, else None."""
    cfg.check()
    for flag, v in (("--vae", cfg.vae), ("--media", cfg.media), ("--captions", cfg.captions), ("--out", cfg.out)):
        if not v:
            raise ConfigError(f"{flag} is required (or --pipeline DIR for --vae)" if flag == "--vae"
                              else f"{flag} is required")
    spec = VAESpec.from_folder(cfg.vae)
    frames, height, width = (d if v is None else v for v, d in zip((cfg.frames, cfg.height, cfg.width),
                                                                    DEFAULT_SIZE[spec.kind]))
    latent_shape = spec.latent_shape(frames, height, width)
    _, _, text_config = resolve_folders(cfg.text_encoder, cfg.tokenizer)
    if not os.path.isdir(cfg.media):
        raise DataError(f"--media {cfg.media}: not a directory (the folder the captions' paths are relative to)")
    if os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise ConfigError(f"--out {cfg.out}: exists and is not a directory")
    clips = read_captions(cfg.captions, spec.kind, frames)
    cond_shape = (cfg.max_text_len, text_config["d_model"])
    settings = {"vae": spec.class_name, "latent_shape": list(latent_shape), "cond_shape": list(cond_shape),
                "frames": frames, "height": height, "width": width, "fps": cfg.fps, "dtype": cfg.dtype,
                "sample_posterior": cfg.sample_posterior, "seed": cfg.seed if cfg.sample_posterior else None,
                "shard_size": cfg.shard_size, "text_encoder": text_config["model_type"]}
    chunks = plan_shards(clips, cfg.shard_size)
    done = finished_shards(cfg.out, settings, chunks)
    os.makedirs(cfg.out, exist_ok=True)

    rank, world = _world()
    if world > 1:  # the rendezvous is the barrier between every rank's look at --out and any write
        dist.init_process_group("gloo", timeout=timedelta(hours=24))
    try:
        device, compute = _device_and_dtype(cfg)
        mine = [k for k in range(len(chunks)) if k % world == rank and k not in done]
        if rank == 0:
            print(f"prepare_data: {len(clips)} clips in {len(chunks)} shards of {cfg.shard_size}, {len(done)} "
                  f"already written; {world} rank(s) on {device} ({compute}); latents {list(latent_shape)}, "
                  f"cond {list(cond_shape)}", flush=True)
        text = TextEncoder.from_folder(cfg.text_encoder, cfg.tokenizer, device, compute) if mine or rank == 0 else None
        vae = LatentVAE.from_folder(cfg.vae, device, compute) if mine else None
        start = time.perf_counter()
        if mine:
            _encode_shards(cfg, chunks, mine, vae, text, latent_shape, (frames, height, width), settings, rank, world)
        if world > 1:
            dist.barrier()
        if rank != 0:
            return None
        negative = _encode_texts(text, [cfg.negative_prompt], cfg)[0][0]
        heads = read_shard_headers(cfg.out, len(chunks))
        report = build_report(heads, done, time.perf_counter() - start, world)
        index_error = None
        try:
            write_index(cfg.out, heads, latent_shape, cond_shape)
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


def _encode_shards(cfg, chunks, mine, vae, text, latent_shape, size, settings, rank, world) -> None:
    items = [item for k in mine for item in chunks[k]]
    loader = torch.utils.data.DataLoader(_ClipReader(items, cfg.media, size, cfg.fps), batch_size=None,
                                         num_workers=cfg.workers)
    ends = {}  # the item position that closes each shard -> shard id
    pos = 0
    for k in mine:
        pos += len(chunks[k])
        ends[pos - 1] = k
    video = vae.kind == "wan"
    latents, written, captions, skipped, batch = [], [], [], [], []

    def flush():
        if batch:
            pixels = torch.stack([b[1] for b in batch])
            noise = _noise([b[0] for b in batch], latent_shape, cfg.seed) if cfg.sample_posterior else None
            latents.append(vae.encode(pixels, noise).to("cpu", DTYPES[cfg.dtype]))
            batch.clear()

    bar = tqdm(total=len(items), unit="clip", disable=rank != 0, desc=f"rank 0/{world}", dynamic_ncols=True)
    with bar:
        for i, frames, reason in loader:
            index, clip = items[i]
            if frames is None:
                skipped.append((clip.path, reason))
            else:
                batch.append((index, to_pixels(frames.to(vae.device), video)))  # uint8 over the bus
                written.append(clip.path)
                captions.append(clip.caption)
                if len(batch) == cfg.batch_size:
                    flush()
            if i in ends:
                flush()
                k = ends[i]
                cond, text_len = _encode_texts(text, captions, cfg)
                lat = torch.cat(latents) if latents else torch.zeros(0, *latent_shape, dtype=DTYPES[cfg.dtype])
                write_shard(cfg.out, k, lat, cond, text_len, settings, chunks[k], written, skipped)
                latents, written, captions, skipped = [], [], [], []
                bar.set_postfix_str(f"shard {k}")
            bar.update(1)


def prepare_prompts(cfg: PrepConfig) -> Optional[List[str]]:
    """`--prompts-only`: one prompt per non-blank line of cfg.prompts -> write_prompts(cfg.out, ...) with the
    negative prompt. Rank 0 only. Returns the prompts."""
    cfg.check()
    if not cfg.prompts or not os.path.isfile(cfg.prompts):
        raise DataError(f"--prompts {cfg.prompts}: no such file (one prompt per line)")
    if not cfg.out or os.path.isdir(cfg.out):
        raise ConfigError(f"--out {cfg.out}: with --prompts-only, the safetensors file to write")
    resolve_folders(cfg.text_encoder, cfg.tokenizer)
    with open(cfg.prompts, encoding="utf-8") as f:
        texts = [line.strip() for line in f if line.strip()]
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
