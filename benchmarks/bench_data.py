"""The streaming shard reader against the in-memory reader: samples/s and peak host memory, in one run.

    python benchmarks/bench_data.py [--stream-gb 20] [--memory-gb 3] [--dir /tmp/dmd2_bench_data]
                                    [--workers 2] [--micro-batch 4] [--keep]

Samples are shaped like Wan 2.1 480p / 81-frame training data: latents bf16 [16, 21, 60, 104] (4.2 MB) and
UMT5 text bf16 [512, 4096] (4.2 MB), 8.4 MB per sample, in 64-sample shards. Two sets are written one shard at a
time (never whole in memory) under --dir and removed at the end unless --keep:
  small  --memory-gb of shards: the largest set the in-memory reader is asked to hold (it keeps float32, so it
         needs twice that), read (1) by the in-memory reader (`load_shards`, then batches indexed from memory)
         and (2) streaming (`ShardDataset` + `MicroBatchLoader` with --workers DataLoader workers);
  large  --stream-gb of shards, read streaming only, one whole epoch in the sampler's shuffled order.
For each it prints the open time, samples/s over the epoch (batches moved to the device's float32 as training
does: here the CPU), and the peak RSS growth of the training process over its start, plus the largest growth of
any DataLoader worker (sampled every 5 ms; batches are touched, as a training step would). The in-memory
reader's peak is its whole set; the streaming reader's must not depend on the set's size.
The page cache is not dropped (that needs root); a set smaller than free memory may be read from it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from dmd2_mega.data import GlobalBatchSampler, ShardDataset, load_shards  # noqa: E402
from dmd2_mega.data.loader import MicroBatchLoader, device_batch  # noqa: E402

LATENT = (16, 21, 60, 104)
TEXT = (512, 4096)
PER_SHARD = 64
CPU = torch.device("cpu")


def sample_bytes() -> int:
    n = 1
    for s in LATENT:
        n *= s
    return 2 * (n + TEXT[0] * TEXT[1])


def write_set(path: str, gb: float) -> int:
    """ceil(gb / shard size) shards of bf16 latents + text, written one at a time; returns the sample count."""
    os.makedirs(path, exist_ok=True)
    shards = max(1, math.ceil(gb * 1e9 / (sample_bytes() * PER_SHARD)))
    g = torch.Generator().manual_seed(0)
    base_x = torch.randn(PER_SHARD, *LATENT, generator=g).bfloat16()
    base_c = torch.randn(PER_SHARD, *TEXT, generator=g).bfloat16()
    entries = []
    t0 = time.time()
    for i in range(shards):  # distinct values per shard without paying for fresh random numbers each time
        name = f"shard_{i:05d}.safetensors"
        save_file({"latents": base_x + i, "cond": base_c - i}, os.path.join(path, name))
        entries.append({"file": name, "num_samples": PER_SHARD})
        print(f"\r  writing {path}: shard {i + 1}/{shards} ({(i + 1) * PER_SHARD * sample_bytes() / 1e9:.1f} GB, "
              f"{time.time() - t0:.0f} s)", end="", flush=True)
    print()
    with open(os.path.join(path, "index.json"), "w") as f:
        json.dump({"shards": entries, "latent_shape": list(LATENT), "cond": "embedding", "cond_shape": list(TEXT)}, f)
    return shards * PER_SHARD


class PeakRSS:
    """Peak RSS growth of this process and of its children (each over its first reading), sampled every 5 ms."""

    def __enter__(self):
        self.me, self.stop = psutil.Process(), threading.Event()
        self.base, self.peak, self.child_base, self.child_peak = self.me.memory_info().rss, 0, {}, 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.me.memory_info().rss - self.base)
            for c in self.me.children():
                try:
                    rss = c.memory_info().rss
                except psutil.Error:
                    continue
                base = self.child_base.setdefault(c.pid, rss)
                self.child_peak = max(self.child_peak, rss - base)
            self.stop.wait(0.005)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def read_in_memory(path: str, micro: int) -> dict:
    with PeakRSS() as rss:
        t0 = time.time()
        ds = load_shards(path)
        opened = time.time() - t0
        sampler = GlobalBatchSampler(len(ds), micro, micro, seed=0)
        t0, n = time.time(), 0
        for _ in range(sampler.iters_per_epoch):
            for _, idx in sampler.next_iteration():
                x, c = device_batch(*ds.get_batch(idx), CPU)
                x.sum(), c.sum()
                n += x.shape[0]
        secs = time.time() - t0
    del ds
    return {"open_s": opened, "samples": n, "samples_per_s": n / secs, "rss": rss.peak, "worker_rss": 0}


def read_streaming(path: str, micro: int, workers: int) -> dict:
    with PeakRSS() as rss:
        t0 = time.time()
        ds = ShardDataset(path)
        opened = time.time() - t0
        sampler = GlobalBatchSampler(len(ds), micro, micro, seed=0)
        loader = MicroBatchLoader(ds, sampler, CPU, num_workers=workers)
        t0, n = time.time(), 0
        for it in range(sampler.iters_per_epoch):
            for _, x, c in loader.next_iteration():
                x.sum(), c.sum()  # touch the batch as a training step does
                n += x.shape[0]
            if it % 50 == 0:
                print(f"\r  streaming {path}: {n}/{len(ds)} samples, {n / (time.time() - t0):.1f} samples/s",
                      end="", flush=True)
        secs = time.time() - t0
        loader.close()
    print()
    return {"open_s": opened, "samples": n, "samples_per_s": n / secs, "rss": rss.peak, "worker_rss": rss.child_peak}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stream-gb", type=float, default=20.0)
    p.add_argument("--memory-gb", type=float, default=3.0)
    p.add_argument("--dir", default="/tmp/dmd2_bench_data")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--keep", action="store_true")
    a = p.parse_args(argv)
    need = (a.stream_gb + a.memory_gb) * 1e9 * 1.05
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(a.dir)) or ".").free
    if free < need:
        sys.exit(f"error: --dir {a.dir}: the sets need {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
    if psutil.virtual_memory().available < 2.2 * a.memory_gb * 1e9:
        sys.exit(f"error: --memory-gb {a.memory_gb}: the in-memory reader holds it as float32 (2x); lower it")
    print(f"> {psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, torch {torch.__version__}; "
          f"sample {sample_bytes() / 1e6:.1f} MB (latents bf16 {list(LATENT)} + text bf16 {list(TEXT)}), "
          f"{PER_SHARD} per shard; micro-batch {a.micro_batch}, {a.workers} workers")
    small, large = os.path.join(a.dir, "small"), os.path.join(a.dir, "large")
    rows = []
    try:
        n_small = write_set(small, a.memory_gb)
        rows.append(("in-memory (load_shards)", n_small, read_in_memory(small, a.micro_batch)))
        rows.append((f"streaming, {a.workers} workers", n_small, read_streaming(small, a.micro_batch, a.workers)))
        shutil.rmtree(small, ignore_errors=True)
        n_large = write_set(large, a.stream_gb)
        rows.append((f"streaming, {a.workers} workers", n_large, read_streaming(large, a.micro_batch, a.workers)))
    finally:
        if not a.keep:
            shutil.rmtree(a.dir, ignore_errors=True)
    base = rows[0][2]["samples_per_s"]
    print("\n| reader | set | open (s) | samples/s | vs in-memory | peak RSS growth, trainer | worst worker |")
    print("|---|---|---|---|---|---|---|")
    for name, n, r in rows:
        print(f"| {name} | {n} samples, {n * sample_bytes() / 1e9:.1f} GB | {r['open_s']:.2f} | "
              f"{r['samples_per_s']:.1f} | {r['samples_per_s'] / base:.2f}x | {r['rss'] / 2**30:.2f} GiB | "
              f"{r['worker_rss'] / 2**30:.2f} GiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
