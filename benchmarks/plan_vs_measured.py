"""The memory planner's per-rank figures against what a CPU run allocates, at debug sizes, as a table.

    python benchmarks/plan_vs_measured.py [--model-size wan-debug] [--data synthetic] [--latent-shape 4 5 6 10]
                                          [--cond-shape 3 16 | --num-classes 10] [--samples 3] [--csv out.csv]
    python benchmarks/plan_vs_measured.py --model-size debug --data digits      # any family, any --data

`--model-size` of any family on the sample shape and condition kind of `--data` (what the trainers read:
digits, moving-digits, a shard directory; its `data_info`), or with `--data synthetic` (the default) on
`--latent-shape` [C, *spatial] with text embeddings `--cond-shape` (labels of `--num-classes` when given). The
default, wan-debug on latents [4, 5, 6, 10] with text [3, 16] (75 tokens: odd, so CP pads it) and 3 samples:
  * the bytes a trained role holds after its second optimizer step (weights, the fp32 gradient buffer, the
    optimizer state), fp32 and bf16, plain AdamW and the distributed optimizer, in a world of one;
  * the bytes a training forward keeps for backward (saved-tensor hooks and selective recompute's caches: unique
    non-parameter storages), at each --recompute-granularity (none, selective, full), fp32 and bf16, at TP=1 (a
    world of one) and, per rank under torchrun with 2 gloo ranks, at TP=2 and, for a family that splits tokens (`ModelFamily.splits_tokens`), at CP=2 and
    TP=2 with --sequence-parallel.
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
from torch.utils._pytree import tree_leaves  # noqa: E402

from dmd2_mega.models import recompute  # noqa: E402
from dmd2_mega.plan import memory_plan as mp  # noqa: E402
from dmd2_mega.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from dmd2_mega.train.offload import resident_bytes  # noqa: E402

# layout -> (TP, CP, sequence parallel); the token-split ones only for a family that splits tokens
LAYOUTS = {"CP=2": (1, 2, False), "TP=2": (2, 1, False), "TP=2 SP": (2, 1, True)}


def kept_bytes(model, inputs) -> int:
    """Bytes of the unique non-parameter storages a training forward of `inputs` saves for backward: what autograd
    saves (saved-tensor hooks) and what selective recompute's checkpoints cache from the forward (the op outputs
    torch's selective checkpoint stores, read from each checkpoint's forward dispatch mode)."""
    params = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    kept, caches = {}, []

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            kept[st.data_ptr()] = st.nbytes()
        return t

    def contexts():
        caching, cached = selective()
        caches.append(caching.storage)
        return caching, cached
    selective, recompute.selective_contexts = recompute.selective_contexts, contexts
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*inputs)
    finally:
        recompute.selective_contexts = selective
    for entry in tree_leaves(caches):  # the outputs kept, each wrapped with its version counter
        if torch.is_tensor(getattr(entry, "val", None)):
            pack(entry.val)
    del out
    return sum(kept.values())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-size", default="wan-debug", help="a registered size of any family, or a model folder")
    p.add_argument("--data", default="synthetic", help="digits | moving-digits | a shard directory | synthetic")
    p.add_argument("--latent-shape", type=int, nargs="+", default=[4, 5, 6, 10], help="--data synthetic: C [T] H W")
    p.add_argument("--cond-shape", type=int, nargs="+", default=[3, 16],
                   help="--data synthetic: per-sample embeddings [L, D] (or [D])")
    p.add_argument("--num-classes", type=int, default=None, help="--data synthetic: labels instead of embeddings")
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--csv", default=None)
    p.add_argument("--rank-report", nargs=2, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def info(a) -> dict:
    """The data_info the model is built for: `--data`'s, or the synthetic shape of the flags."""
    if a.data != "synthetic":
        from dmd2_mega.data import build_dataset
        from dmd2_mega.train.builders import data_info
        return data_info(build_dataset(a.data, "train"))
    labels = a.num_classes is not None
    return {"num_classes": a.num_classes, "cond_shape": None if labels else tuple(a.cond_shape),
            "in_channels": a.latent_shape[0], "latent_shape": list(a.latent_shape)}


def inputs(ms: mp.ModelShape, n: int, seed: int = 0):
    """(x [n, C, *spatial], sigma [n], cond: labels [n] or embeddings [n, *cond_shape]) drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    cond = (torch.randint(0, ms.num_classes, (n,), generator=g) if ms.cond_shape is None
            else torch.randn(n, *ms.cond_shape, generator=g))
    return torch.randn(n, ms.in_channels, *ms.spatial, generator=g), torch.rand(n, generator=g), cond


def layouts(ms: mp.ModelShape) -> dict:
    """The torchrun layouts this model's family supports (TP x DP always; CP and SP where it splits tokens)."""
    return {k: v for k, v in LAYOUTS.items() if ms.family.splits_tokens or (v[1] == 1 and not v[2])}


def activation_rows(a, data: dict, ps, layout: str, tp: int, cp: int, sp: bool) -> list:
    from dmd2_mega.train.builders import build_model, cast_model
    ms, rows = mp.model_shape_from_info(a.model_size, data), []
    for bf16 in (False, True):
        for how in recompute.GRANULARITIES:
            cfg = ModelConfig(size=a.model_size, recompute_granularity=how)
            model = cast_model(build_model(cfg, data, ps), bf16).train()
            got = kept_bytes(model, inputs(ms, a.samples))
            est = mp.saved_activation_bytes(ms, a.samples, tp, bf16, how, cp=cp, sp=sp)
            rows.append([layout, f"kept for backward, {'bf16' if bf16 else 'fp32'}"
                         f"{'' if how == 'none' else f', recompute {how}'}", est, got])
    return rows


def role_rows(a, data: dict, ps) -> list:
    from dmd2_mega.train.builders import build_grads_and_optimizer, build_model, cast_model
    ms, rows = mp.model_shape_from_info(a.model_size, data), []
    for bf16 in (False, True):
        for dist_opt in (False, True):
            model = cast_model(build_model(ModelConfig(size=a.model_size), data, ps), bf16).train()
            grads, opt = build_grads_and_optimizer(model, OptimConfig(lr=1e-3, bf16=bf16,
                                                                      use_distributed_optimizer=dist_opt), ps)
            for step in range(2):
                model(*inputs(ms, a.samples, step)).float().square().mean().backward()
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


def rank_main(a, layout: str, out: str) -> None:
    """Under torchrun: this layout's activation rows, written by rank 0."""
    from dmd2_mega.distributed.parallel import destroy_distributed, init_distributed
    tp, cp, sp = LAYOUTS[layout]
    ps = init_distributed(ParallelConfig(tp, cp, sp))
    rows = activation_rows(a, info(a), ps, layout, tp, cp, sp)
    if ps.rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    destroy_distributed()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    if a.rank_report:
        rank_main(a, *a.rank_report)
        return 0
    from dmd2_mega.distributed.parallel import destroy_distributed, init_distributed
    data = info(a)
    ms = mp.model_shape_from_info(a.model_size, data)
    ps = init_distributed(ParallelConfig())
    rows = role_rows(a, data, ps) + activation_rows(a, data, ps, "TP=1", 1, 1, False)
    destroy_distributed()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1", "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory() as d:
        for layout in layouts(ms):
            out = os.path.join(d, "rows.json")
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            os.path.abspath(__file__), *argv, "--rank-report", layout, out], check=True,
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
            rows += json.load(open(out))
    table = [[layout, what, f"{est:,}", f"{got:,}", f"{est / got:.4f}"] for layout, what, est, got in rows]
    cond = (f"labels of {ms.num_classes} classes" if ms.cond_shape is None
            else f"text {' x '.join(map(str, ms.cond_shape))}")
    skipped = [k for k in LAYOUTS if k not in layouts(ms)]
    print(f"{a.model_size} ({ms.family.title}), --data {a.data}: latents {ms.in_channels}x"
          f"{'x'.join(map(str, ms.spatial))} ({ms.tokens} tokens), {cond}, {a.samples} samples; bytes per rank "
          f"(rank 0 under torchrun)" + (f"; not run: {', '.join(skipped)} (the {ms.family.title} family does not "
                                        f"split tokens)" if skipped else ""))
    print(mp.format_table(["layout", "what", "planned", "measured", "planned / measured"], table, left=2))
    worst = max(abs(est / got - 1) for _, _, est, got in rows)
    print(f"largest deviation: {100 * worst:.2f}%")
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            csv.writer(f).writerows([["layout", "what", "planned", "measured", "ratio"]] + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
