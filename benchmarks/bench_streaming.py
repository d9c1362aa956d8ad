"""Streaming generation of a causal student: the time per chunk at the training length T and past it, with and
without a rolling window, as medians over repeats in one run (issue 30, item 4's streaming ratio).

    python benchmarks/bench_streaming.py [--model-size wan-digits] [--latent 1 8 16 16] [--text-len 4]
        [--chunk-frames 2] [--window 2] [--sink 1] [--batch 16] [--steps 4] [--repeats 5] [--threads 2]

A random causal model of --model-size (weights do not change the cost) streams --batch clips of T frames and of
2T and 4T frames with the few-step sampler (`sampling.stream_student`, --steps per chunk, the cache written at
level 0), once with the rolling window (--window W chunks, --sink S) and once with full causal attention. Printed:
the median time per chunk over the stream (the first chunk apart) at each length, its ratio to T's (the window
should keep it near 1: a constant cost per chunk; with full attention it grows with the cache), and the first
chunk's time. CPU or CUDA (timed with synchronisation at each chunk).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dmd2_mega.config import ModelConfig, ParallelConfig  # noqa: E402
from dmd2_mega.distributed.parallel import destroy_distributed, init_distributed  # noqa: E402
from dmd2_mega.models import DataShape, build_model, get_spec  # noqa: E402
from dmd2_mega.sampling import stream_student  # noqa: E402
from dmd2_mega import flow  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-size", default="wan-digits")
    p.add_argument("--latent", type=int, nargs=4, default=[1, 8, 16, 16], metavar=("C", "T", "H", "W"))
    p.add_argument("--text-len", type=int, default=4)
    p.add_argument("--chunk-frames", type=int, default=2)
    p.add_argument("--window", type=int, default=2)
    p.add_argument("--sink", type=int, default=1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def stream_times(model, shape: tuple, cond: torch.Tensor, sigmas: torch.Tensor, seed: int) -> list[float]:
    """Seconds per chunk of one stream of clips [C, F, H, W] (F = shape[1])."""
    noise = torch.randn((len(sigmas), cond.shape[0], *shape), generator=torch.Generator().manual_seed(seed))
    cuda = noise.device.type == "cuda"
    times, t0 = [], time.perf_counter()
    with torch.no_grad():
        for _ in stream_student(model, noise, cond, sigmas):
            if cuda:
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            times.append(t1 - t0)
            t0 = t1
    return times


def main(argv=None) -> int:
    a = parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    ps = init_distributed(ParallelConfig(), seed=0)
    try:
        c, t, h, w = a.latent
        rows = []
        for label, window, sink in (("window", a.window, a.sink), ("full causal", None, 0)):
            cfg = ModelConfig(a.model_size, causal=True, causal_chunk_frames=a.chunk_frames,
                              causal_local_attn_chunks=window, causal_sink_chunks=sink)
            spec = get_spec(a.model_size)
            shape = DataShape(c, (t, h, w), cond_shape=(a.text_len, spec.text_dim))
            model = build_model(a.model_size, shape, 1, cfg.options()).to(ps.device).eval()
            cond = torch.randn(a.batch, a.text_len, spec.text_dim, generator=torch.Generator().manual_seed(1))
            sigmas = flow.student_sigmas(a.steps)
            mults = (1, 2, 4)
            reps = {m: [] for m in mults}
            for r in range(a.repeats + 1):  # round-robin over the lengths (drifting load hits each alike); 0 warms up
                for m in mults:
                    times = stream_times(model, (c, t * m, h, w), cond, sigmas, r)
                    reps[m] += [times] if r else []
            per_len = {m: (statistics.median(x for run in reps[m] for x in run[1:] or run),  # the first chunk apart
                           statistics.median(run[0] for run in reps[m]), len(reps[m][0])) for m in mults}
            base = per_len[1][0]
            for mult, (chunk, first, n) in per_len.items():
                rows.append((label, t * mult, n, 1e3 * chunk, chunk / base, 1e3 * first))
        print(f"device: {ps.device} | torch {torch.__version__} | threads {torch.get_num_threads()} | {a.model_size} | "
              f"latent {c}x{t}x{h}x{w} (T = {t}) | batch {a.batch} | {a.steps} steps per chunk | chunks of "
              f"{a.chunk_frames} frames | window {a.window} + sink {a.sink} | median of {a.repeats}")
        print(f"{'attention':<12} {'frames':>6} {'chunks':>6} {'ms/chunk':>9} {'vs T':>6} {'first chunk ms':>15}")
        for label, frames, n, ms, ratio, first in rows:
            print(f"{label:<12} {frames:>6} {n:>6} {ms:>9.1f} {ratio:>6.3f} {first:>15.1f}")
        window_2t = next(r[4] for r in rows if r[0] == "window" and r[1] == 2 * t)
        print(f"acceptance: streaming per-chunk time 2T / T with the window <= 1.2: {window_2t:.3f} -> "
              f"{'PASS' if window_2t <= 1.2 else 'FAIL'}")
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
