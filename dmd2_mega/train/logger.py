"""Rank-0 logging in Megatron's shape, optional TensorBoard, a progress bar on a terminal.

Log line:  iteration  100/ 1000 | consumed samples: 6400 | elapsed time per iteration (ms): 85.1 |
           learning rate: 1.000E-03 | loss: 4.123E-01 | grad norm: 0.532 | samples per second: 752.1 |
           model TFLOP/s per GPU: 0.012
(a DMD2 cycle also logs its phases' times, `rollout-ms`, `critic-ms`, `actor-ms`; `throughput.py`).
With a curves file (<save>/curves.jsonl) the interval's proxies and every eval's numbers also go there
(`train/curves.py`).
"""
from __future__ import annotations

import json
import sys
import time
from typing import Optional

import numpy as np

from dmd2_mega.train.curves import CurveRecord


def print_rank0(msg: str, rank: int = 0) -> None:
    if rank == 0:
        print(msg, flush=True)


def report_eval(logger: "TrainLogger", result: dict, iteration: int, unit: str, rank: int) -> None:
    """Print an eval result on one line (`> eval at cycle 300: ...`) and log its scalars as eval/*; its
    `media` (an `eval.media.MediaFiles`, printed as its directory) go to TensorBoard (`TrainLogger.media`)."""
    if not result:
        return
    print_rank0(f"> eval at {unit} {iteration}: " + ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()), rank)
    logger.scalars(iteration, {f"eval/{k}": v for k, v in result.items() if isinstance(v, float)})
    if logger.curves is not None:
        logger.curves.eval(iteration, result)
    if result.get("media") is not None:
        logger.media(iteration, result["media"].shown)


class TrainLogger:
    def __init__(self, rank: int, train_iters: int, tensorboard_dir: Optional[str] = None,
                 loss_trace: Optional[str] = None, start_iteration: int = 0, curves: Optional[str] = None,
                 unit: str = "iteration"):
        """`curves`: the run's curves.jsonl (`train/curves.py`), opened at `start_iteration`; `unit` names an
        iteration in it ("iteration", "cycle")."""
        self.rank, self.train_iters = rank, train_iters
        self.writer = self.bar = self.trace = self.curves = None
        self.last_time, self.last_iter = time.time(), start_iteration
        if rank != 0:
            return
        if curves:
            self.curves = CurveRecord(curves, unit, start_iteration)
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(tensorboard_dir)
        if loss_trace:
            self.trace = open(loss_trace, "a")
        if sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=train_iters, initial=start_iteration, dynamic_ncols=True, leave=False)

    def log(self, iteration: int, consumed: int, metrics: dict, per_iter: list[dict]) -> None:
        """`metrics`: scalars averaged over the interval; `per_iter`: one dict per iteration."""
        if self.rank != 0:
            return
        now = time.time()
        n = max(iteration - self.last_iter, 1)
        ms = (now - self.last_time) * 1000 / n
        samples = metrics.pop("_samples_per_iter", 0)
        flops = metrics.pop("_flops_per_iter", None)  # model FLOPs per GPU of one iteration (throughput.py)
        parts = [f" iteration {iteration:8d}/{self.train_iters:8d}", f"consumed samples: {consumed:12d}",
                 f"elapsed time per iteration (ms): {ms:.1f}"]
        for k, v in metrics.items():
            if "nan iterations" in k:
                parts.append(f"{k}: {int(v)}")
            elif "loss" in k or "learning rate" in k or k.endswith("-lr"):
                parts.append(f"{k}: {v:.3E}")
            else:
                parts.append(f"{k}: {v:.3f}")
        parts.append(f"samples per second: {samples * 1000 / max(ms, 1e-9):.1f}")
        if flops:
            metrics["model TFLOP/s per GPU"] = flops / max(ms, 1e-9) / 1e9
            parts.append(f"model TFLOP/s per GPU: {metrics['model TFLOP/s per GPU']:.4g}")
        line = " | ".join(parts) + " |"
        (self.bar.write if self.bar else print)(line)
        sys.stdout.flush()
        if self.writer:
            for k, v in metrics.items():
                self.writer.add_scalar("train/" + k.replace(" ", "-"), v, iteration)
        if self.trace:
            for rec in per_iter:
                self.trace.write(json.dumps(rec) + "\n")
            self.trace.flush()
        if self.curves is not None:
            self.curves.train(iteration, metrics)
        if self.bar:
            self.bar.update(iteration - self.last_iter)
        self.last_time, self.last_iter = now, iteration

    def scalars(self, iteration: int, values: dict) -> None:
        if self.rank == 0 and self.writer:
            for k, v in values.items():
                self.writer.add_scalar(k, v, iteration)

    def media(self, iteration: int, files: dict) -> None:
        """{name: file} as TensorBoard images `eval/<name>`: a `.gif` (a video) goes in as is, the Summary.Image
        that SummaryWriter.add_video builds (which needs moviepy to make the GIF); a `.png` through add_image."""
        if self.rank != 0 or not self.writer:
            return
        from PIL import Image
        from tensorboard.compat.proto.summary_pb2 import Summary
        for name, path in files.items():
            tag = f"eval/{name}"
            with Image.open(path) as im:
                if path.endswith(".gif"):
                    with open(path, "rb") as f:
                        image = Summary.Image(height=im.height, width=im.width, colorspace=3,
                                              encoded_image_string=f.read())
                    self.writer._get_file_writer().add_summary(
                        Summary(value=[Summary.Value(tag=tag, image=image)]), iteration)
                else:
                    pixels = np.asarray(im.convert("RGB"))
                    self.writer.add_image(tag, pixels, iteration, dataformats="HWC")

    def close(self) -> None:
        if self.bar:
            self.bar.close()
        if self.writer:
            self.writer.close()
        if self.trace:
            self.trace.close()
        if self.curves is not None:
            self.curves.close()
