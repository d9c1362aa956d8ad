#!/usr/bin/env python
"""Sample a checkpoint: a teacher with the Euler sampler and CFG, a DMD2 student with its few-step sampler.

    python launch/sample.py --load runs/teacher --num-samples 500 --steps 50 --guidance 1.5 \
        --out runs/samples            # -> runs/samples/samples.npz + runs/samples/grid.png
    torchrun --nproc-per-node 2 launch/sample.py ... --tensor-model-parallel-size 2

samples.npz: `images` float32 [N, C, H, W] in [-1, 1] (video latents [N, C, T, H, W]; their grid.png has one row
per sample, frames along it, channel 0), `labels`
int64 [N] (class-balanced, 0..K-1 repeated; for embedding-conditioned models the first N conditions of --data,
whose negative-prompt embedding is CFG's negative branch). A Wan teacher converted from diffusers records no
data: --data is required, and --shift defaults to 1 (Wan's pipelines sample 480p with 3.0, 720p with 5.0).
The checkpoint may have been saved at any TP degree; weights are resharded on load. A DMD2 student
(`launch/pretrain_dmd2.py --save`) samples on the grid saved in its checkpoint unless --steps N is
given (then the N-point grid, shifted), and with the EMA weights saved beside it (--ema-decay)
unless --no-ema; --guidance applies to teachers only.
--prompts FILE (an eval-prompts file, `dmd2_mega.data.prompts`): the conditions are its P prompt embeddings
(sample i gets prompt i % P; --num-samples defaults to P), its negative (when stored) is CFG's negative branch,
`labels` is the prompt index and `prompts` the prompt text of each sample. An image-to-video model reads a file
written with `prepare_data.py --prompts-only --images` (an image with each prompt), whose parts must be the
checkpoint's. --image FILE --prompt TEXT --pipeline DIR makes that file for one image and prompt
(<out>/conditions.safetensors, at the checkpoint's size; the pipeline's VAE decodes the media unless --vae). The
image is read once before anything is loaded (an unreadable one is an error naming --image), and a run that fails
leaves neither that file nor an --out folder it created.
--data moving-digits: the conditions cycle through all 40 (digit, direction) prompts, and samples.npz also holds
`digits` and `directions` int64 [N], which `python -m dmd2_mega.eval.report_video` scores; --data moving-digits-i2v
(image-to-video) gives each prompt a held-out clip's first frame and adds `first_frames` float32 [N, 1, H, W], the
given frames (report_video's first-frame error).
Media (`dmd2_mega.eval.media`) in <out>/media/ for the first --num-media samples (default: one per prompt of
--prompts, else 40 videos or the grid's images), named by prompt (`<i>_<slug>`), by moving-digits prompt (`007_7_right`) or by index (`000`):
--vae DIR (a diffusers VAE folder, `dmd2_mega.prep.vae.LatentVAE`) decodes the latents on the main rank: a video
is written as <name>.mp4 (H.264) + <name>.gif, an image as <name>.png, and grid.png shows the decoded images.
Pixel-space video data (--data moving-digits) needs no decoding and gets the MP4 + GIF too; latents without --vae
get samples.npz + grid.png only. The VAE's config (latent channels, video or image) is checked against the model
before any sampling, and its weights are loaded before sampling as well.
Samples are made --batch-size per rank at a time (`sampling.sample_batches`: the noise is the one seeded draw
`generate` / `generate_student` make up front, read batch by batch) and samples.npz is written as they come
(`eval.npz_stream`), so memory is O(batch + the first samples kept for grid.png and the media), whatever
--num-samples; results do not depend on --batch-size up to float rounding (bit for bit when one batch holds all).
<out>/timing.json: the model's time to the first output (--stream: the first chunk) and for all samples
(`SampleTimer`).
A bad flag or checkpoint (missing --load, --iteration not saved, a corrupt file, --out a file, a --vae,
--prompts or --data that does not fit the model, ...) exits 1 with one line `<ErrorType>: <message>` on stderr.
"""
import argparse
import contextlib
import csv
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dmd2_mega.files.atomic import atomic_write  # noqa: E402
from dmd2_mega.train.builders import data_info  # noqa: E402
from dmd2_mega.train.checkpoint import load_payload  # noqa: E402
from dmd2_mega.config import ParallelConfig  # noqa: E402
from dmd2_mega.data import build_dataset  # noqa: E402
from dmd2_mega.errors import ConfigError, DataError  # noqa: E402
from dmd2_mega.data.prompts import read_prompts  # noqa: E402
from dmd2_mega.data.moving_digits import DIRECTIONS  # noqa: E402
from dmd2_mega.eval.grid import save_grid, save_video_grid  # noqa: E402
from dmd2_mega.eval.npz_stream import NpzStream  # noqa: E402
from dmd2_mega.eval.media import (check_vae, holds_pixels, media_names, require_ffmpeg, viewable_scale,  # noqa: E402
                                  write_png, write_samples)
from dmd2_mega.models import DataShape  # noqa: E402
from dmd2_mega.distributed.parallel import destroy_distributed, init_distributed  # noqa: E402
from dmd2_mega.files.path_guard import check_outputs_apart  # noqa: E402
from dmd2_mega.prep.vae import LatentVAE, VAESpec  # noqa: E402
from dmd2_mega.train.resilience import run_main  # noqa: E402
from dmd2_mega.sampling import (add_sampler_flags, check_checkpoint, check_out_dir, check_sampler_flags,  # noqa: E402
                                checkpoint_sampler, eval_conditions, load_sampling_model, sample_batches)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", help="checkpoint directory (Megatron layout); required")
    p.add_argument("--iteration", type=int, default=None, help="default: latest_checkpointed_iteration.txt")
    p.add_argument("--num-samples", type=int, default=None, help="default 100, or one per prompt of --prompts")
    add_sampler_flags(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64,
                   help="samples per rank at a time (memory is O(batch), whatever --num-samples)")
    p.add_argument("--out", help="output directory for samples.npz and grid.png; required")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--data", default=None, help="condition source for embedding-conditioned models")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--no-ema", action="store_true", help="DMD2 student: sample its raw weights, not its EMA")
    p.add_argument("--prompts", metavar="FILE", default=None,
                   help="eval-prompts file (prepare_data.py --prompts-only): the conditions, instead of --data's")
    p.add_argument("--vae", metavar="DIR", default=None,
                   help="diffusers VAE folder: decode the latents and write MP4 + GIF (video) / PNG (image) media")
    p.add_argument("--image", metavar="FILE", default=None,
                   help="image-to-video: the first frame to start from, with --prompt and --pipeline (the condition "
                        "made as prepare_data.py --prompts-only --images makes it, into <out>/conditions.safetensors)")
    p.add_argument("--prompt", metavar="TEXT", default=None, help="with --image: the prompt")
    p.add_argument("--pipeline", metavar="DIR", default=None,
                   help="with --image: the diffusers I2V pipeline folder whose text encoder, VAE and image encoder "
                        "make the condition (its VAE also decodes the media unless --vae)")
    p.add_argument("--stream", action="store_true",
                   help="a causal checkpoint (--causal): generate chunk by chunk with its KV cache, print the time to "
                        "the first chunk and the chunks per second; with media, each chunk's frames are written as "
                        "they come (<out>/stream/<name>/frame_NNNN.png)")
    p.add_argument("--num-frames", type=int, default=None, metavar="F",
                   help="latent frames of a video model's clips (default: the training length): --stream runs on "
                        "past it chunk by chunk; a bidirectional model denoises all F frames at once")
    p.add_argument("--num-media", type=int, default=None, metavar="N",
                   help="media for the first N samples only (default: one per prompt of --prompts, else 40 videos "
                        "or the grid's 10 images per class; 0: none)")
    a = p.parse_args(argv)
    if a.load is None:
        raise ConfigError("--load is required (the checkpoint directory to sample)")
    if a.out is None:
        raise ConfigError("--out is required (the output directory for samples.npz and grid.png)")
    check_out_dir(a.out)
    check_outputs_apart([("--out", a.out)], [("--load", a.load), ("--data", a.data), ("--prompts", a.prompts),
                                              ("--vae", a.vae)])
    if a.num_samples is not None and a.num_samples < 1:
        raise ConfigError(f"--num-samples must be >= 1, got {a.num_samples}")
    if a.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {a.batch_size}")
    check_sampler_flags(a.steps, a.guidance, a.shift)
    if a.iteration is not None and a.iteration < 0:
        raise ConfigError(f"--iteration must be >= 0, got {a.iteration}")
    if a.num_media is not None and a.num_media < 0:
        raise ConfigError(f"--num-media must be >= 0, got {a.num_media}")
    if a.num_frames is not None and a.num_frames < 1:
        raise ConfigError(f"--num-frames {a.num_frames}: must be >= 1")
    if a.image or a.prompt or a.pipeline:
        given = [f for f, v in (("--image FILE", a.image), ("--prompt TEXT", a.prompt), ("--pipeline DIR", a.pipeline))
                 if not v]
        if given or a.prompts or a.data:
            raise ConfigError(f"--image, --prompt and --pipeline go together (missing: {' '.join(given) or 'none'}) "
                              f"and replace --prompts / --data")
        check_image(a.image)
        a.vae = a.vae or os.path.join(a.pipeline, "vae")
    return a


def check_image(path: str) -> None:
    """--image FILE: an image, or a video whose first frame is used, that can be read (a ConfigError / DataError
    naming --image otherwise), checked before anything is loaded or written."""
    from dmd2_mega.prep.media import IMAGE_EXT, VIDEO_EXT, load_clip
    if not os.path.isfile(path):
        raise ConfigError(f"--image {path}: no such file (an image, or a video whose first frame is used)")
    if os.path.splitext(path)[1].lower() not in IMAGE_EXT + VIDEO_EXT:
        raise ConfigError(f"--image {path}: not an image or a video (expected one of "
                          f"{' '.join(IMAGE_EXT + VIDEO_EXT)})")
    frame, reason = load_clip(path, 1, 16, 16)  # the first frame, decoded whole: the size does not matter here
    if frame is None:
        raise DataError(f"--image {path}: {reason} (expected an image, or a video whose first frame is used)")


def main(argv=None) -> int:
    """0 after writing the samples; 1 with a one-line `<ErrorType>: <message>` for a bad flag or checkpoint."""
    return run_main(lambda: sample(parse(argv)), destroy_distributed)


def sample(a: argparse.Namespace) -> None:
    """`sample_into` --out; a run that fails leaves nothing of --image's there (`remove_made`)."""
    made = []  # what --image writes into --out (image_prompt), in order: folders, then conditions.safetensors
    try:
        sample_into(a, made)
    except BaseException:
        remove_made(made)
        raise


def remove_made(made: list) -> None:
    """Remove the paths of `made`, last first: files, and folders that are empty (others' files stay)."""
    for path in reversed(made):
        if os.path.isfile(path):
            os.unlink(path)
        elif os.path.isdir(path):
            with contextlib.suppress(OSError):  # not empty: another writer's files
                os.rmdir(path)


def sample_into(a: argparse.Namespace, made: list) -> None:
    check_checkpoint(a.load, a.iteration)
    vae_spec = VAESpec.from_folder(a.vae, "--vae") if a.vae else None  # its config: checked before any work
    ps = init_distributed(ParallelConfig(a.tensor_model_parallel_size), seed=a.seed)
    payload = load_payload(a.load, ps, a.iteration)
    args, info = payload["args"], payload["data_info"]
    if a.image:
        a.prompts = image_prompt(a, info, ps, made)
    data = a.data or (args.get("train") or {}).get("data")
    dataset = None
    text = info is None or info["num_classes"] is None
    if text and (info is None or a.prompts is None or a.data):  # text conditions (a converted teacher's shape)
        if data is None:
            raise ConfigError(f"--load {a.load} was converted from diffusers and records no data: give --data DIR "
                              f"(the text embeddings to sample, and the latent shape)")
        dataset = build_dataset(data)
        if info is not None:
            check_conditions(dataset, info, data, a.load)
        info = info or data_info(dataset)
    prompts = None
    if a.prompts:
        if info["num_classes"] is not None:
            raise ConfigError(f"--prompts {a.prompts}: --load {a.load} is class-conditional ({info['num_classes']} "
                              f"classes); prompt embeddings need a text-conditioned model")
        prompts = read_prompts(a.prompts, info["cond_shape"], flag="--prompts", cond_parts=info.get("cond_parts"))
    a.num_samples = a.num_samples or (len(prompts.texts) if prompts is not None else 100)
    shape = DataShape.from_info(info).sample_shape
    if a.num_frames is not None:
        if len(shape) != 4:
            raise ConfigError(f"--num-frames: --load {a.load} makes images {list(shape)}, not video")
        shape = (shape[0], a.num_frames, *shape[2:])
    media = check_media(a, vae_spec, data, shape)
    vae = LatentVAE.from_folder(a.vae, device=ps.device, flag="--vae") if a.vae and ps.is_main else None
    negative = (prompts.negative.float() if prompts is not None and prompts.negative is not None else
                dataset.negative if dataset is not None else None)
    model, weights = load_sampling_model(payload, info, ps, no_ema=a.no_ema, bf16=a.bf16, source=f"--load {a.load}",
                                         negative=negative)  # a DMD2 student: its EMA unless --no-ema
    n, k = a.num_samples, 10 * (info["num_classes"] or 10)  # at most 10 samples per class in the grid
    n_media = min(n, a.num_media if a.num_media is not None else
                  len(prompts.texts) if prompts is not None else DEFAULT_MEDIA if len(shape) == 4 else k)
    media = media and n_media > 0
    clock = StreamClock(a.out, n_media if media and ps.is_main else 0, vae, ps.device) if a.stream else None
    sampler = checkpoint_sampler(payload, a.steps, a.guidance, a.shift, a.stream, clock and clock.chunk)
    head = min(n, max(k if len(shape) == 3 else 16, n_media if media else 0))  # kept for the grid and media

    def cond_of(lo: int, hi: int) -> torch.Tensor:  # samples lo .. hi - 1; prompts: sample i gets prompt i % P
        if prompts is not None:
            return prompts.cond.float()[torch.arange(lo, hi) % len(prompts.texts)]
        if info["num_classes"] is not None:
            return torch.arange(lo, hi) % info["num_classes"]
        return eval_conditions(dataset, hi - lo, lo)

    scored = prompts is None and hasattr(dataset, "condition_labels")  # moving digits: `digits`, `directions`, ...
    arrays = {"images": ((n, *shape), np.float32), "labels": ((n,), np.int64)}
    if prompts is not None:
        arrays["prompts"] = ((n,), f"<U{max(1, *(len(t) for t in prompts.texts[:n]))}")
    if scored:
        arrays.update((key, ((n, *v.shape[1:]), v.dtype)) for key, v in dataset.condition_labels(cond_of(0, 1)).items())
    batches = sample_batches(model, sampler, n, cond_of, shape=shape, seed=a.seed, batch_size=a.batch_size,
                             device=ps.device, dp_rank=ps.dp_rank, dp_size=ps.dp_size, dp_group=ps.dp_group)
    kept, clock_of = [], SampleTimer(clock)

    def write(f) -> None:  # samples.npz, batch by batch (module docstring)
        stream = NpzStream(f, arrays, a.out)
        try:
            for lo, x in clock_of(batches):
                hi = lo + x.shape[0]
                c = cond_of(lo, hi)
                stream.write("images", x.numpy())
                # class labels are the condition; text: the index of the prompt / data condition
                stream.write("labels", c.numpy() if c.dim() == 1 else
                             np.arange(lo, hi) % (len(prompts.texts) if prompts is not None else n))
                if prompts is not None:
                    stream.write("prompts", np.array([prompts.texts[i % len(prompts.texts)] for i in range(lo, hi)]))
                if scored:
                    for key, values in dataset.condition_labels(c).items():
                        stream.write(key, values)
                if lo < head:
                    kept.append(x[:head - lo])
            stream.close()
        except BaseException:
            stream.abort()
            raise

    if ps.is_main:
        try:
            os.makedirs(a.out, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--out {a.out!r}: cannot create the output directory: {e.strerror}") from e
        clock and clock.start()
        atomic_write(os.path.join(a.out, "samples.npz"), write)
        clock_of.save(os.path.join(a.out, "timing.json"), n, a.batch_size)
    else:
        for _ in batches:  # the other ranks' shares of every batch
            pass
    if clock is not None and ps.is_main:
        print(clock.summary(sampler.describe()), flush=True)
    a.steps, a.guidance = sampler.steps, sampler.guidance
    del model, batches  # the VAE decodes next
    if ps.is_main:
        images = torch.cat(kept)  # the first `head` samples
        png = os.path.join(a.out, "grid.png")
        names = (prompts.names() if prompts is not None else
                 media_labels(**dataset.condition_labels(cond_of(0, n_media))) if scored and media else None)
        shown = (write_samples(os.path.join(a.out, "media"), images[:n_media], media_names(n_media, names),
                               vae, keep=k)[1] if media else [])
        labels_k = cond_of(0, min(n, k)) if info["num_classes"] is not None else None
        if shown:  # images decoded by --vae: the grid shows their pixels
            grid = save_grid(torch.stack(shown), labels_k, png, upscale=viewable_scale(*shown[0].shape[1:]))
        elif images.dim() == 4:
            grid = save_grid(images[:k], labels_k, png)
        else:  # video: one row per sample, frames along it (latents: channel 0)
            grid = save_video_grid(images[:16], png)
        print(f"> wrote {n} samples {list(shape)} (iteration {payload['iteration']}, "
              f"{weights}, {a.steps} steps, guidance {a.guidance}) to {a.out}/samples.npz"
              + f" and {grid}" + (f"; media in {a.out}/media" if media else ""), flush=True)


class SampleTimer:
    """<out>/timing.json: how long sampling took, model time only (the samples.npz writes and, with --stream, the
    media writes not counted): `first_output_s`, the wait for the first output (--stream: the first chunk of the
    first batch; else the first batch's whole clips), `total_s` for all samples, and `num_samples`, `batch_size`,
    `stream`. What launch/quickstart_causal.sh's table (`eval.report_video`) reports as time to the first chunk
    and total sampling time."""

    def __init__(self, clock: "StreamClock | None"):
        self.clock, self.first, self.total, self.waited = clock, None, 0.0, 0.0

    def __call__(self, batches):
        start = time.perf_counter()
        for lo, x in batches:
            self.waited += time.perf_counter() - start
            self.first = self.waited if self.first is None else self.first
            yield lo, x
            start = time.perf_counter()

    def save(self, path: str, n: int, batch_size: int) -> None:
        paused = self.clock.paused if self.clock is not None else 0.0
        first = self.clock.first if self.clock is not None else self.first
        timing = {"first_output_s": first, "total_s": self.waited - paused, "num_samples": n,
                  "batch_size": batch_size, "stream": self.clock is not None}
        atomic_write(path, lambda f: json.dump(timing, f, indent=1), text=True)


class StreamClock:
    """--stream: times the chunks as they come (the first one from the start of sampling; the media writing below is
    not counted) and writes the frames of the first `n_media` samples of the first batch as PNGs as each chunk comes,
    decoded by `vae` when given with its causal cache kept between chunks (`prep.vae.StreamDecoder`: the frames are
    the whole clip's decode)."""

    def __init__(self, out: str, n_media: int, vae, device):
        self.out, self.n_media, self.vae, self.device = out, n_media, vae, device
        self.t0, self.first, self.chunks, self.frames, self.batch = None, None, 0, 0, -1
        self.written: dict = {}  # sample -> frames written
        self.decoder = None  # --vae: the stream decoder of the first batch's media samples
        self.paused = 0.0  # seconds spent decoding and writing media: not the model's time

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def chunk(self, x0: torch.Tensor, first_frame: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter() - (self.t0 or time.perf_counter()) - self.paused  # the media writes not counted
        self.batch += first_frame == 0
        self.first = now if self.first is None else self.first
        self.chunks, self.frames, self.elapsed = self.chunks + 1, self.frames + x0.shape[-3], now
        start = time.perf_counter()
        if self.batch == 0 and self.n_media:  # the VAE's causal cache kept from chunk to chunk: the whole clip's frames
            if first_frame == 0 and self.vae is not None:
                self.decoder = self.vae.stream_decoder()
            media = x0[:self.n_media]
            media = self.decoder.decode(media) if self.vae is not None else media
            for i, pixels in enumerate(media.float().cpu()):
                folder = os.path.join(self.out, "stream", f"{i:03d}")
                os.makedirs(folder, exist_ok=True)
                done = self.written.get(i, 0)
                for t in range(pixels.shape[1]):
                    write_png(os.path.join(folder, f"frame_{done + t:05d}.png"), pixels[:, t])
                self.written[i] = done + pixels.shape[1]
        self.paused += time.perf_counter() - start

    def summary(self, how: str) -> str:
        if not self.chunks:
            return "> streamed nothing"
        return (f"> streamed {self.chunks} chunks ({self.frames} latent frames, {how}): first chunk after "
                f"{self.first:.3f} s, {self.chunks / self.elapsed:.2f} chunks/s, {self.frames / self.elapsed:.2f} "
                f"latent frames/s" + (f"; frames of the first {self.n_media} samples in {self.out}/stream"
                                      if self.n_media else ""))


DEFAULT_MEDIA = 40
"""Videos written without --prompts (one clip per moving-digits prompt; each MP4 spawns an ffmpeg). Images
default to the grid's count, whose decoded pixels grid.png shows."""


def check_conditions(dataset, info: dict, data: str, load: str) -> None:
    """DataError naming --data, --load and both condition shapes (the widths last) unless the data's conditions are
    the text embeddings the model takes."""
    want = tuple(info["cond_shape"])
    if dataset.cond_shape is None:
        raise DataError(f"--data {data} holds class labels ({dataset.num_classes} classes), but --load {load} takes "
                        f"text embeddings {list(want)} (width {want[-1]})")
    got = tuple(dataset.cond_shape)
    if got != want:
        raise DataError(f"--data {data} holds text embeddings {list(got)} (width {got[-1]}), but --load {load} takes "
                        f"{list(want)} (width {want[-1]}); give the data encoded with the model's text encoder")


def image_prompt(a: argparse.Namespace, info: dict, ps, made: list) -> str:
    """--image --prompt --pipeline: the one condition, written by prepare_data's --prompts-only --images (on the main
    rank; the others wait) to <out>/conditions.safetensors at the checkpoint's size and text length, from a one-row
    --images file in a temporary folder. What it creates in --out (folders, then the file once it is whole) is added
    to `made`; prepare_data's errors name the flags given here (`in_flags_given`)."""
    from dmd2_mega.prep.run import PrepConfig, prepare_image_prompts
    if info is None:
        raise ConfigError(f"--image {a.image}: --load {a.load} was converted from diffusers and records no data size; "
                          f"write the condition at the size you want with prepare_data.py --prompts-only --images and "
                          f"give --prompts FILE --data DIR")
    parts = dict(info.get("cond_parts") or ())
    if "image" not in parts:
        raise ConfigError(f"--image {a.image}: --load {a.load} is not an image-to-video model (its data has no image "
                          f"part); give --prompts FILE or --data")
    out = os.path.join(a.out, "conditions.safetensors")
    if ps.is_main:
        spec = VAESpec.from_folder(os.path.join(a.pipeline, "vae"), "--pipeline")
        c, t, h, w = info["latent_shape"]
        text_encoder = os.path.join(a.pipeline, "text_encoder")
        folder = os.path.abspath(a.out)
        while not os.path.exists(folder):  # the folders the write may create: removed again if the run fails
            made.insert(0, folder)
            folder = os.path.dirname(folder)
        with tempfile.TemporaryDirectory(prefix="sample_image_") as tmp:
            rows = os.path.join(tmp, "conditions.csv")
            with open(rows, "w", newline="") as f:
                csv.writer(f).writerows([["path", "caption"], [os.path.abspath(a.image), a.prompt]])
            try:
                prepare_image_prompts(PrepConfig(
                    text_encoder=text_encoder, vae=spec.path, pipeline=a.pipeline, images=rows, out=out,
                    frames=(t - 1) * spec.temporal_factor + 1, height=h * spec.spatial_factor,
                    width=w * spec.spatial_factor, max_text_len=parts["text"][0], dtype="fp32", batch_size=1))
            except (ConfigError, DataError) as e:
                raise type(e)(in_flags_given(str(e), a, rows, text_encoder)) from e
        made.append(out)
    if dist.is_initialized():
        dist.barrier()
    return out


def in_flags_given(message: str, a: argparse.Namespace, rows: str, text_encoder: str) -> str:
    """prepare_data's message in the flags the user gave: its --images (the one-row file made for it) is --image,
    its --text-encoder <pipeline>/text_encoder is --pipeline's."""
    image = f"--image {a.image}"
    for said, given in ((f"--images {rows} line 2: image {os.path.abspath(a.image)!r}: ", f"{image}: "),
                        (f"--images {rows} line 2", image), (f"--images {rows}", image),
                        (f"--text-encoder {text_encoder}", f"--pipeline {a.pipeline}: its text encoder "
                                                           f"{text_encoder}")):
        message = message.replace(said, given)
    return message


def media_labels(digits: np.ndarray, directions: np.ndarray, **_) -> list:
    """Moving digits: a media name per sample, `<i>_<digit>_<direction>` (e.g. `007_7_right`)."""
    return [f"{i:03d}_{d}_{DIRECTIONS[r]}" for i, (d, r) in enumerate(zip(digits.tolist(), directions.tolist()))]


def check_media(a: argparse.Namespace, vae_spec, data, shape: tuple) -> bool:
    """Whether media are written (--vae, or pixel-space video data); ConfigError naming --vae for a VAE that cannot
    decode the model's latents [C, ...] (or pixel data), or naming imageio-ffmpeg when video needs it."""
    video = len(shape) == 4
    if vae_spec is not None:
        if holds_pixels(data):
            raise ConfigError(f"--vae {a.vae}: --data {data} holds pixels, not latents; there is nothing to decode")
        check_vae(vae_spec, shape, f"--vae {a.vae}")
    media = vae_spec is not None or (video and holds_pixels(data))
    if media and video:
        require_ffmpeg(f"--vae {a.vae}" if a.vae else f"sampling --data {data} (video media)")
    return media


if __name__ == "__main__":
    sys.exit(main())
