#!/usr/bin/env python
"""Make `--data` shards (or an `--eval-prompts` file) from local media, captions or class folders, and model folders.

    # videos + captions -> Wan 2.1 latents [16, 21, 60, 104] and UMT5 embeddings [512, 4096], 8 GPUs
    torchrun --nproc-per-node 8 launch/prepare_data.py --pipeline /models/Wan2.1-T2V-1.3B-Diffusers \
        --media /data/clips --captions /data/clips/captions.csv --out /data/wan_shards \
        --frames 81 --height 480 --width 832
    # ImageNet train/<wnid>/*.JPEG -> sd-vae-ft-ema latents [4, 32, 32] and labels in [0, 1000) (ADM's centre crop)
    torchrun --nproc-per-node 8 launch/prepare_data.py --labels-from-folders --num-classes 1000 \
        --vae /models/sd-vae-ft-ema --media /data/imagenet/train --out /data/in256 --shard-size 1024 --batch-size 64
    # the validation prompts (no VAE)
    python launch/prepare_data.py --prompts-only --pipeline /models/Wan2.1-T2V-1.3B-Diffusers \
        --prompts prompts.txt --out eval_prompts.safetensors
    # image-to-video: an I2V pipeline folder adds each clip's first-frame condition (CLIP + image latent) to cond
    torchrun --nproc-per-node 8 launch/prepare_data.py --pipeline /models/Wan2.1-I2V-14B-480P-Diffusers \
        --media /data/clips --captions /data/clips/captions.csv --out /data/wan_i2v --frames 81 --height 480 --width 832
    python launch/prepare_data.py --prompts-only --pipeline /models/Wan2.1-I2V-14B-480P-Diffusers \
        --images eval_images.csv --out eval_i2v.safetensors --frames 81 --height 480 --width 832

A re-run with the same flags keeps finished shards and does the rest; a second run on an --out that another
run is writing exits 1 with one line naming it (the trainers' lock file, <out>/.dmd2_mega.lock). Unreadable and
too-short files are skipped and listed in <out>/report.json. A bad flag or file, a malformed captions row (by
line; --skip-bad-captions leaves such rows out and lists them in report.json) exits 1 with one line naming it,
before any encoding. Details: docs/prepare_data.md; the code: dmd2_mega/prep/.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dmd2_mega.errors import ConfigError, DataError  # noqa: E402
from dmd2_mega.files.path_guard import check_outputs_apart  # noqa: E402
from dmd2_mega.prep.run import DTYPES, PrepConfig, prepare, prepare_prompts  # noqa: E402
from dmd2_mega.prep.text import DEFAULT_NEGATIVE  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("models (local folders; nothing is downloaded)")
    m.add_argument("--pipeline", metavar="DIR", help="a diffusers pipeline folder: its vae/, text_encoder/, tokenizer/")
    m.add_argument("--vae", metavar="DIR", help="a diffusers AutoencoderKLWan (video) or AutoencoderKL (image) folder")
    m.add_argument("--text-encoder", metavar="DIR", help="a transformers UMT5 (or T5) encoder folder")
    m.add_argument("--tokenizer", metavar="DIR", help="default: --text-encoder, else its sibling tokenizer/")
    m.add_argument("--image-condition", choices=["concat", "first-frame"],
                   help="image-to-video data without an I2V --pipeline folder (which decides it itself): concat "
                        "(Wan 2.1 / 2.2 I2V: the latent of [first frame, zeros]) or first-frame (Wan 2.2 TI2V: the "
                        "first frame's latent); must agree with --pipeline's transformer")
    m.add_argument("--image-encoder", metavar="DIR", help="a transformers CLIPVisionModel folder (Wan 2.1 I2V; "
                                                          "default <pipeline>/image_encoder)")
    m.add_argument("--image-processor", metavar="DIR", help="its CLIPImageProcessor folder (default: --image-encoder "
                                                            "if it holds preprocessor_config.json, else its sibling "
                                                            "image_processor/)")
    d = p.add_argument_group("data")
    d.add_argument("--media", metavar="DIR", help="the folder of videos (mp4/webm/gif/...) or images (png/jpg); "
                                                  "with --labels-from-folders: DIR/<class>/<image>")
    d.add_argument("--labels-from-folders", action="store_true",
                   help="class-conditional images: label = the index of the image's class folder among the sorted "
                        "subfolders of --media (ImageFolder's order), ADM / DiT centre crop to a square, an "
                        "AutoencoderKL --vae; no captions or text encoder")
    d.add_argument("--num-classes", type=int, metavar="K", help="with --labels-from-folders: the number of class "
                                                                "folders expected (1000 for ImageNet)")
    d.add_argument("--captions", metavar="FILE", help="CSV or JSONL with 'path' (relative to --media) and 'caption'")
    d.add_argument("--skip-bad-captions", action="store_true",
                   help="leave malformed captions rows out (listed in <out>/report.json) instead of refusing the file")
    d.add_argument("--out", metavar="PATH", help="the shard directory (or, with --prompts-only, the .safetensors file)")
    d.add_argument("--frames", type=int, help="frames per clip (Wan: 4k + 1; default 81 for Wan, 1 for an image VAE)")
    d.add_argument("--height", type=int, help="pixels, a multiple of the VAE's factor (default 480 Wan / 256; "
                                               "--labels-from-folders: square, one of the two sets both)")
    d.add_argument("--width", type=int, help="pixels, a multiple of the VAE's factor (default 832 Wan / 256)")
    d.add_argument("--fps", type=float, help="sample frames at this rate from the clip's start "
                                             "(default: --frames evenly over the whole clip)")
    d.add_argument("--shard-size", type=int, default=64, help="clips per shard (default 64)")
    d.add_argument("--sample-posterior", action="store_true", help="draw from the VAE posterior (default: its mean)")
    d.add_argument("--seed", type=int, default=0, help="for --sample-posterior (per clip: seed and clip index)")
    t = p.add_argument_group("text")
    t.add_argument("--max-text-len", type=int, default=512, help="tokens per caption, zero-padded (default 512)")
    t.add_argument("--negative-prompt", default=DEFAULT_NEGATIVE,
                   help="stored as negative.safetensors (default: WanPipeline's documented negative prompt)")
    t.add_argument("--prompts-only", action="store_true", help="encode --prompts only and write --out (no VAE)")
    t.add_argument("--prompts", metavar="FILE", help="with --prompts-only: a text file, one prompt per line")
    t.add_argument("--images", metavar="FILE", help="with --prompts-only, image-to-video: a CSV / JSONL with 'path' "
                                                    "(an image; relative to --media, else to FILE's folder) and "
                                                    "'caption' per eval condition")
    r = p.add_argument_group("run")
    r.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="stored latents / embeddings")
    r.add_argument("--compute-dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                   help="the models' dtype (auto: bf16 on GPU, fp32 on CPU)")
    r.add_argument("--device", default="auto", help="auto: cuda:LOCAL_RANK when there is CUDA, else cpu")
    r.add_argument("--batch-size", type=int, default=1, help="clips per VAE call (default 1)")
    r.add_argument("--text-batch-size", type=int, default=16, help="captions per text-encoder call (default 16)")
    r.add_argument("--workers", type=int, default=4, help="processes reading media (default 4; 0 reads inline)")
    return p.parse_args(argv)


def to_config(a: argparse.Namespace) -> PrepConfig:
    """Flags -> PrepConfig; --pipeline DIR fills --vae / --text-encoder / --tokenizer not given (only --vae with
    --labels-from-folders); its model_index.json and transformer/ decide image-to-video (prep/image.py)."""
    vae, text_encoder, tokenizer = a.vae, a.text_encoder, a.tokenizer
    if a.pipeline:
        if not os.path.isdir(a.pipeline):
            raise ConfigError(f"--pipeline {a.pipeline}: not a directory (expected a diffusers pipeline folder with "
                              f"vae/, text_encoder/, tokenizer/)")
        vae = vae or os.path.join(a.pipeline, "vae")
        if not a.labels_from_folders:
            text_encoder = text_encoder or os.path.join(a.pipeline, "text_encoder")
            tokenizer = tokenizer or os.path.join(a.pipeline, "tokenizer")
    if a.labels_from_folders and a.prompts_only:
        raise ConfigError("--prompts-only encodes text; it does not go with --labels-from-folders")
    if not text_encoder and not a.labels_from_folders:
        raise ConfigError("--text-encoder DIR (or --pipeline DIR) is required (or --labels-from-folders for class "
                          "folders)")
    if a.prompts_only and a.vae and not a.images:
        raise ConfigError("--prompts-only encodes text only; drop --vae (or give --images FILE: image-to-video)")
    for flag, v in (("--prompts FILE", a.prompts), ("--images FILE", a.images)):
        if v and not a.prompts_only:
            raise ConfigError(f"{flag} goes with --prompts-only")
    return PrepConfig(
        text_encoder=text_encoder, tokenizer=tokenizer, vae=None if a.prompts_only and not a.images else vae,
        media=a.media,
        captions=a.captions, out=a.out, prompts=a.prompts, frames=a.frames, height=a.height, width=a.width,
        fps=a.fps, max_text_len=a.max_text_len, negative_prompt=a.negative_prompt, shard_size=a.shard_size,
        dtype=a.dtype, compute_dtype=a.compute_dtype, sample_posterior=a.sample_posterior, seed=a.seed,
        batch_size=a.batch_size, text_batch_size=a.text_batch_size, workers=a.workers, device=a.device,
        skip_bad_captions=a.skip_bad_captions, labels_from_folders=a.labels_from_folders,
        num_classes=a.num_classes, pipeline=a.pipeline, image_condition=a.image_condition,
        image_encoder=a.image_encoder, image_processor=a.image_processor, images=a.images)


def main(a: argparse.Namespace) -> None:
    cfg = to_config(a)
    check_outputs_apart([("--out", a.out)], [("--pipeline", a.pipeline), ("--vae", cfg.vae),
                                             ("--text-encoder", cfg.text_encoder), ("--tokenizer", cfg.tokenizer),
                                             ("--media", a.media), ("--captions", a.captions), ("--prompts", a.prompts),
                                             ("--image-encoder", a.image_encoder),
                                             ("--image-processor", a.image_processor), ("--images", a.images)])
    if a.prompts_only:
        prepare_prompts(cfg)
    else:
        prepare(cfg)


def run(argv=None) -> int:
    """The exit status: 0, or 1 with ONE line `<ErrorType>: <message>` on stderr for a bad flag or file, 130 on
    Ctrl-C. (resilience.run_main's contract, without importing the training stack, i.e. megatron-core.)"""
    prefix = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
    try:
        main(parse_args(argv))
        return 0
    except (ConfigError, DataError) as e:
        print(f"{prefix}{type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print(f"{prefix}Interrupted (SIGINT); finished shards are kept, re-run to continue", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(run())
