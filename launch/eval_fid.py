#!/usr/bin/env python
"""FID of a checkpoint's samples against reference statistics, as the papers measure it (Inception pool3, 2048-d).

    python launch/eval_fid.py --load runs/student --ref-stats VIRTUAL_imagenet256_labeled.npz \
        --inception-weights inception-2015-12-05.pt --num-samples 50000 --vae sd-vae-ft-ema --out runs/fid
    torchrun --nproc-per-node 8 launch/eval_fid.py ...        # data parallel: each rank makes its share

Samples: N class-balanced ones, sample i with label i % K. A DMD2 student (its checkpoint holds "student_sigmas")
runs its few-step sampler on its own saved grid (or the shifted --steps grid) with its EMA weights unless --no-ema;
a teacher runs --steps Euler steps (default 50) with CFG --guidance and --shift (default: the checkpoint's
--timestep-shift), exactly as launch/sample.py. Sample i's noise comes from its own generator seeded by
(--seed, i) (`sampling.keyed_noise`), so the result does not depend on the number of ranks or --batch-size.
Rank r of P makes samples r, r + P, ... in batches of --batch-size: latents -> --vae decode (pixel-space data
such as the embedded digits needs none; grey is repeated to 3 channels) -> uint8 (--pixel-rounding) -> Inception
features -> float64 running sums; the sums are all-reduced once at the end, so memory is O(batch), never O(N).
The maths, the pixel rule and the file conventions: `dmd2_mega/eval/fid.py`, `dmd2_mega/eval/inception.py`.
--inception-weights is a local TorchScript file (inception-2015-12-05.pt of StyleGAN2-ADA / StyleGAN3 /
clean-fid); nothing is downloaded. TF32 is off, so the features are full fp32 like the reference statistics'.
Every rank loads the whole model (TP = 1).

Output: progress lines (samples done / N, samples/s), then one line
    > FID 12.3456 (N=50000, student 1 steps, EMA weights, ref VIRTUAL_imagenet256_labeled.npz, inception ...)
and with --out <out>/fid.json; --save-stats FILE.npz writes the samples' `mu` / `sigma` in the reference-file
convention. A bad flag or file exits 1 with one line `<ErrorType>: <message>` on stderr, before any sampling.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dmd2_mega.files.atomic import atomic_write  # noqa: E402
from dmd2_mega.train.checkpoint import load_payload  # noqa: E402
from dmd2_mega.config import ParallelConfig  # noqa: E402
from dmd2_mega.errors import ConfigError, NonFiniteError  # noqa: E402
from dmd2_mega.eval.fid import (ROUNDING, check_ref_width, load_ref_stats, pixels_to_uint8, save_stats,  # noqa: E402
                                shard_indices, stream_stats)
from dmd2_mega.eval.frechet import gaussian_frechet  # noqa: E402
from dmd2_mega.eval.inception import check_inception_file, load_inception  # noqa: E402
from dmd2_mega.eval.media import check_vae, holds_pixels  # noqa: E402
from dmd2_mega.models import DataShape  # noqa: E402
from dmd2_mega.distributed.parallel import destroy_distributed, init_distributed  # noqa: E402
from dmd2_mega.files.path_guard import check_outputs_apart  # noqa: E402
from dmd2_mega.prep.vae import LatentVAE, VAESpec  # noqa: E402
from dmd2_mega.train.resilience import run_main  # noqa: E402
from dmd2_mega.sampling import (add_sampler_flags, check_checkpoint, check_out_dir, check_sampler_flags,  # noqa: E402
                                checkpoint_sampler, keyed_noise, load_sampling_model)

PROGRESS_SECONDS = 30.0
"""A progress line at most this often (and after the last batch)."""


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", help="checkpoint directory (Megatron layout); required")
    p.add_argument("--iteration", type=int, default=None, help="default: latest_checkpointed_iteration.txt")
    p.add_argument("--ref-stats", metavar="FILE", help="reference .npz with 'mu' [D] and 'sigma' [D, D]; required")
    p.add_argument("--inception-weights", metavar="FILE",
                   help="local inception-2015-12-05.pt (TorchScript; never downloaded); required")
    p.add_argument("--num-samples", type=int, default=None, help="N samples, class-balanced; required (papers: 50000)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per rank per batch (memory is O(batch))")
    p.add_argument("--vae", metavar="DIR", default=None, help="diffusers VAE folder decoding latents to pixels")
    p.add_argument("--data", default=None, help="default: the checkpoint's --data (pixels or latents?)")
    add_sampler_flags(p)
    p.add_argument("--seed", type=int, default=0, help="sample i's noise is keyed by (seed, i)")
    p.add_argument("--no-ema", action="store_true", help="DMD2 student: its raw weights, not its EMA")
    p.add_argument("--bf16", action="store_true", help="bf16 model weights and compute (the Inception stays fp32)")
    p.add_argument("--pixel-rounding", choices=ROUNDING, default="round",
                   help="[-1, 1] -> uint8: round (EDM / StyleGAN, default) or floor (ADM / DMD2's eval scripts)")
    p.add_argument("--out", metavar="DIR", default=None, help="write <out>/fid.json")
    p.add_argument("--save-stats", metavar="FILE", default=None, help="write the samples' mu / sigma (.npz)")
    a = p.parse_args(argv)
    for flag, value, what in (("--load", a.load, "the checkpoint directory to evaluate"),
                              ("--ref-stats", a.ref_stats, "the reference statistics .npz"),
                              ("--inception-weights", a.inception_weights, "a local inception-2015-12-05.pt"),
                              ("--num-samples", a.num_samples, "N, e.g. 50000 as the papers")):
        if value is None:
            raise ConfigError(f"{flag} is required ({what})")
    if a.num_samples < 2:
        raise ConfigError(f"--num-samples must be >= 2 (a covariance needs 2 samples), got {a.num_samples}")
    if a.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {a.batch_size}")
    check_sampler_flags(a.steps, a.guidance, a.shift)
    if a.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {a.seed}")
    if a.iteration is not None and a.iteration < 0:
        raise ConfigError(f"--iteration must be >= 0, got {a.iteration}")
    if a.out is not None:
        check_out_dir(a.out, "--out", "fid.json")
    if a.save_stats is not None:
        if os.path.isdir(a.save_stats):
            raise ConfigError(f"--save-stats {a.save_stats} is a directory; expected a file name (.npz)")
        check_out_dir(os.path.dirname(os.path.abspath(a.save_stats)), "--save-stats", "the statistics .npz")
    check_outputs_apart([("--out", a.out), ("--save-stats", a.save_stats)],
                        [("--load", a.load), ("--ref-stats", a.ref_stats), ("--inception-weights", a.inception_weights),
                         ("--vae", a.vae), ("--data", a.data)])
    return a


def main(argv=None) -> int:
    """0 after printing the FID; 1 with a one-line `<ErrorType>: <message>` for a bad flag, file or checkpoint."""
    return run_main(lambda: evaluate(parse(argv)), destroy_distributed)


def image_source(a: argparse.Namespace, payload: dict, vae_spec) -> tuple:
    """(sample shape [C, H, W], pixel size (H, W), number of classes); ConfigError for a model FID cannot score:
    not class-conditional, video, latents without --vae, pixels with --vae, or neither 1 nor 3 pixel channels."""
    info = payload.get("data_info")
    if info is None or info.get("num_classes") is None:
        raise ConfigError(f"--load {a.load} is conditioned on text embeddings; eval_fid.py scores class-conditional "
                          f"image models (sample i has label i % K)")
    shape = DataShape.from_info(info).sample_shape
    if len(shape) != 3:
        raise ConfigError(f"--load {a.load} makes video samples {list(shape)}; FID scores images [C, H, W]")
    data = a.data or (payload["args"].get("train") or {}).get("data")
    if vae_spec is not None:
        if holds_pixels(data):
            raise ConfigError(f"--vae {a.vae}: --data {data} holds pixels, not latents; there is nothing to decode")
        check_vae(vae_spec, shape, f"--vae {a.vae}")
        return shape, (shape[1] * vae_spec.spatial_factor, shape[2] * vae_spec.spatial_factor), info["num_classes"]
    if not holds_pixels(data):
        raise ConfigError(f"--load {a.load} makes latents {list(shape)} (--data {data}); give --vae DIR (the "
                          f"diffusers VAE folder of the data, e.g. sd-vae-ft-ema) to decode them to pixels")
    if shape[0] not in (1, 3):
        raise ConfigError(f"--load {a.load} makes {shape[0]}-channel pixels; FID needs 1 (grey) or 3 (RGB)")
    return shape, tuple(shape[1:]), info["num_classes"]


def evaluate(a: argparse.Namespace) -> float:
    ref_mu, ref_sigma = load_ref_stats(a.ref_stats)  # the cheap checks first: files and configs
    check_inception_file(a.inception_weights)
    check_checkpoint(a.load, a.iteration)
    vae_spec = VAESpec.from_folder(a.vae, "--vae") if a.vae else None
    ps = init_distributed(ParallelConfig(1), seed=a.seed)
    torch.backends.cuda.matmul.allow_tf32 = False  # full fp32 features, as the reference statistics'
    torch.backends.cudnn.allow_tf32 = False
    payload = load_payload(a.load, ps, a.iteration)
    shape, pixel_size, num_classes = image_source(a, payload, vae_spec)
    inception = load_inception(a.inception_weights, ps.device, pixel_size)
    check_ref_width(ref_mu, inception.width, a.ref_stats, a.inception_weights)
    sampler = checkpoint_sampler(payload, a.steps, a.guidance, a.shift)
    model, weights = load_sampling_model(payload, payload["data_info"], ps, no_ema=a.no_ema, bf16=a.bf16,
                                         source=f"--load {a.load}")
    model.eval()
    vae = LatentVAE.from_folder(a.vae, device=ps.device, flag="--vae") if a.vae else None

    def make_images(batch) -> torch.Tensor:
        noise = keyed_noise(a.seed, batch, shape, sampler.draws).to(ps.device)
        x = sampler(model, noise, (torch.as_tensor(list(batch)) % num_classes).to(ps.device))
        return pixels_to_uint8(vae.decode(x) if vae is not None else x, a.pixel_rounding)

    n, world = a.num_samples, ps.world_size
    indices = shard_indices(n, ps.rank, world)
    last = [0.0]

    def progress(done: int, seconds: float) -> None:  # rank 0's count x P: its share is the largest
        if ps.is_main and (seconds - last[0] >= PROGRESS_SECONDS or done == len(indices)):
            last[0] = seconds
            total = min(n, done * world)
            rate = total / max(seconds, 1e-9)
            print(f"> samples {total}/{n} ({rate:.1f} samples/s over {world} rank(s), {seconds:.0f} s, "
                  f"eta {(n - total) / max(rate, 1e-9):.0f} s)", flush=True)

    start = time.time()
    stats = stream_stats(indices, a.batch_size, make_images, inception, inception.width, ps.device, progress)
    stats.all_reduce()
    mu, sigma = stats.mean_cov()
    if stats.count != n:  # a sharding bug, never a user error
        raise RuntimeError(f"feature statistics of {stats.count} samples, expected {n}")
    if not (torch.isfinite(torch.from_numpy(mu)).all() and torch.isfinite(torch.from_numpy(sigma)).all()):
        raise NonFiniteError(f"--inception-weights {a.inception_weights} gave NaN or inf features")
    if not ps.is_main:
        return float("nan")
    fid = gaussian_frechet(mu, sigma, ref_mu, ref_sigma)
    what = f"{sampler.describe()}, {weights}"
    print(f"> FID {fid:.4f} (N={n}, {what}, ref {a.ref_stats}, inception {a.inception_weights})", flush=True)
    if a.save_stats:
        save_stats(a.save_stats, mu, sigma, n)
    if a.out:
        try:
            os.makedirs(a.out, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--out {a.out!r}: cannot create the output directory: {e.strerror}") from e
        record = {"fid": fid, "num_samples": n, "sampler": sampler.describe(), "student": sampler.student,
                  "steps": sampler.steps, "guidance": sampler.guidance, "shift": sampler.shift, "weights": weights,
                  "load": a.load, "iteration": payload["iteration"], "seed": a.seed,
                  "pixel_rounding": a.pixel_rounding, "ref_stats": a.ref_stats,
                  "inception_weights": a.inception_weights, "feature_dim": inception.width, "ranks": world,
                  "batch_size": a.batch_size, "seconds": round(time.time() - start, 3)}
        atomic_write(os.path.join(a.out, "fid.json"), lambda f: json.dump(record, f, indent=1), text=True)
    return fid


if __name__ == "__main__":
    sys.exit(main())
