"""The memory planner's per-rank figures against what a CPU run allocates, at debug sizes, as a table.

    python benchmarks/plan_vs_measured.py [--csv out.csv]

For `wan-debug` on latents [4, 5, 6, 10] with text [3, 16] (75 tokens: odd, so CP pads it) and 3 samples:
  * the bytes a trained role holds after its second optimizer step (weights, the fp32 gradient buffer, the
    optimizer state), fp32 and bf16, plain AdamW and the distributed optimizer, in a world of one;
  * the bytes a training forward keeps for backward (saved-tensor hooks: unique non-parameter storages), with and
    without --recompute-granularity full, fp32 and bf16, at TP=1 (a world of one) and, per rank under torchrun
    with 2 gloo ranks, at CP=2, TP=2 and TP=2 with --sequence-parallel.
Each row prints the planner's figure (dmd2_mega/plan/memory_plan.py), the measured one and their ratio.
tests/test_plan_memory.py asserts the same comparisons (and imports `kept_bytes` from here).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", category=UserWarning)

import torch  # noqa: E402

from dmd2_mega.plan import memory_plan as mp  # noqa: E402
from dmd2_mega.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from dmd2_mega.train.offload import resident_bytes  # noqa: E402

SIZE, CHANNELS, SPATIAL, TEXT, N = "wan-debug", 4, (5, 6, 10), (3, 16), 3
LAYOUTS = {"CP=2": (1, 2, False), "TP=2": (2, 1, False), "TP=2 SP": (2, 1, True)}


def kept_bytes(model, inputs) -> int:
    """Bytes of the unique non-parameter storages a training forward of `inputs` saves for backward."""
    params = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    kept = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            kept[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*inputs)
    del out
    return sum(kept.values())


def info() -> dict:
    return {"num_classes": None, "cond_shape": TEXT, "in_channels": CHANNELS, "latent_shape": [CHANNELS, *SPATIAL]}


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, CHANNELS, *SPATIAL, generator=g), torch.rand(N, generator=g),
            torch.randn(N, *TEXT, generator=g))


def activation_rows(ps, layout: str, tp: int, cp: int, sp: bool) -> list:
    from dmd2_mega.train.builders import build_model, cast_model
    ms, rows = mp.model_shape_from_info(SIZE, info()), []
    for bf16 in (False, True):
        for recompute in (False, True):
            cfg = ModelConfig(size=SIZE, recompute_granularity="full" if recompute else None)
            model = cast_model(build_model(cfg, info(), ps), bf16).train()
            got = kept_bytes(model, inputs())
            est = mp.saved_activation_bytes(ms, N, tp, bf16, recompute, cp=cp, sp=sp)
            rows.append([layout, f"kept for backward, {'bf16' if bf16 else 'fp32'}"
                         f"{', recompute' if recompute else ''}", est, got])
    return rows


def role_rows(ps) -> list:
    from dmd2_mega.train.builders import build_grads_and_optimizer, build_model, cast_model
    ms, rows = mp.model_shape_from_info(SIZE, info()), []
    for bf16 in (False, True):
        for dist_opt in (False, True):
            model = cast_model(build_model(ModelConfig(size=SIZE), info(), ps), bf16).train()
            grads, opt = build_grads_and_optimizer(model, OptimConfig(lr=1e-3, bf16=bf16,
                                                                      use_distributed_optimizer=dist_opt), ps)
            for step in range(2):
                model(*inputs(step)).float().square().mean().backward()
                opt.step()
                opt.zero_grad()
            masters = opt.master_params if opt.mixed or dist_opt else []
            state = [t for st in opt.inner.state.values() for t in st.values() if torch.is_tensor(t)]
            got = {"weights": resident_bytes(list(model.parameters()) + list(model.buffers())),
                   "grads": resident_bytes(p.main_grad for p in model.parameters()),
                   "optimizer": resident_bytes(list(masters) + state)}
            plan = mp.role_bytes(ms, 1, 1, bf16, trained=True, dist_opt=dist_opt)
            what = f"{'bf16' if bf16 else 'fp32'}, {'distributed optimizer' if dist_opt else 'AdamW'}"
            rows += [["TP=1", f"trained role {kind}, {what}", plan[kind], got[kind]] for kind in plan]
            grads.close()
    return rows


def rank_main(layout: str, out: str) -> None:
    """Under torchrun: this layout's activation rows, written by rank 0."""
    from dmd2_mega.distributed.parallel import destroy_distributed, init_distributed
    tp, cp, sp = LAYOUTS[layout]
    ps = init_distributed(ParallelConfig(tp, cp, sp))
    rows = activation_rows(ps, layout, tp, cp, sp)
    if ps.rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    destroy_distributed()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--csv", default=None)
    p.add_argument("--rank-report", nargs=2, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank_report:
        rank_main(*a.rank_report)
        return 0
    from dmd2_mega.distributed.parallel import destroy_distributed, init_distributed
    ps = init_distributed(ParallelConfig())
    rows = role_rows(ps) + activation_rows(ps, "TP=1", 1, 1, False)
    destroy_distributed()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1", "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory() as d:
        for layout in LAYOUTS:
            out = os.path.join(d, "rows.json")
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            os.path.abspath(__file__), "--rank-report", layout, out], check=True, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
            rows += json.load(open(out))
    table = [[layout, what, f"{est:,}", f"{got:,}", f"{est / got:.4f}"] for layout, what, est, got in rows]
    print(f"{SIZE}, latents {CHANNELS}x{'x'.join(map(str, SPATIAL))} ({mp.model_shape_from_info(SIZE, info()).tokens} "
          f"tokens), text {TEXT[0]} x {TEXT[1]}, {N} samples; bytes per rank (rank 0 under torchrun)")
    print(mp.format_table(["layout", "what", "planned", "measured", "planned / measured"], table, left=2))
    worst = max(abs(est / got - 1) for _, _, est, got in rows)
    print(f"largest deviation: {100 * worst:.2f}%")
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            csv.writer(f).writerows([["layout", "what", "planned", "measured", "ratio"]] + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
