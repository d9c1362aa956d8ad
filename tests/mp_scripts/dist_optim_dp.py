"""DistributedOptimizer against optim.Optimizer at DP = 2 (gloo), run by tests/test_dist_optim.py.

Each check trains two copies of one small model from the same weights on the same per-rank batches (two
micro-batches per step, buckets of 40 elements so parameters straddle shard boundaries and padding exists),
one with the plain optimizer and one with the distributed one, and writes what it found to argv[1] (rank 0):
  fp32_exact   no clipping: whether the parameters are bit-equal after every step, their largest difference in
               units of the update scale's rounding (`ulps`, below), and the grad norms' relative difference
  clip         clipping active (max norm 0.05): the same measures
  clip_groups  a model whose last Linear has settings of its own (`Headed`: lr x3, weight decay 0.05 on all its
               parameters, clipped by its own norm to 0.01) and the rest clipped to 0.05: the same measures, and
               `bites`: both groups' norms at the first step exceed their maxes (each clip acts)
  bf16_exact   bf16 model, no clipping: the same measures, in bf16 ulps
  resume       state_dict after step 2 loaded into a fresh distributed optimizer, and into a plain one, each
               continuing to step 4: bit-equal to the uninterrupted run or not, and the difference in ulps
  reshard      the same state loaded at DP = 1 (each rank alone, on both ranks' batches): max abs difference
  state_bytes  optimizer-state bytes per rank (masters + moments), plain and distributed

The plain optimizer steps each parameter tensor and the distributed one flat fragments of the buckets, so torch's
fused AdamW meets the same elements at other offsets of its vector body / scalar tail: bit-equal under
ATEN_CPU_CAPABILITY=default, within a few ulps on a vectorised CPU (tests/test_dist_optim.py runs both).
"""
import copy
import json
import sys

import torch
import torch.distributed as dist

from dmd2_mega.config import OptimConfig
from dmd2_mega.train.dist_optim import DistributedOptimizer
from dmd2_mega.train.grad_buffer import GradBuffer
from dmd2_mega.train.optim import Optimizer

BUCKET = 40


HEAD = {"lr_mult": 3.0, "weight_decay": 0.05, "clip_grad": 0.01}


class Headed(torch.nn.Sequential):
    """make_model's layers, the last Linear (module "3") a head with optimizer settings of its own."""

    def param_options(self) -> dict:
        return {"3.": HEAD}


def make_model(dtype=torch.float32, cls=torch.nn.Sequential) -> torch.nn.Module:
    torch.manual_seed(0)
    return cls(torch.nn.Linear(7, 13), torch.nn.LayerNorm(13), torch.nn.GELU(), torch.nn.Linear(13, 5)).to(dtype)


def batches(rank: int, step: int, dtype):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [(torch.randn(6, 7, generator=g).to(dtype), torch.randn(6, 5, generator=g).to(dtype)) for _ in range(2)]


def build(distributed: bool, cfg: OptimConfig, dtype=torch.float32, model=None, dp_group="world"):
    model = model if model is not None else make_model(dtype)
    group = dist.group.WORLD if dp_group == "world" else dp_group
    grads = GradBuffer(model, group, bucket_elements=BUCKET, shard=distributed)
    opt = (DistributedOptimizer if distributed else Optimizer)(model, cfg, None, group, grads)
    return model, opt, grads


def train_step(model, opt, grads, step: int, ranks=None):
    """Two micro-batches (the first under no_sync), then one optimizer step; `ranks`: whose batches (default
    this rank's), each a micro-batch pair, for the DP = 1 run that sees both ranks' data."""
    dtype = next(model.parameters()).dtype
    pairs = [mb for r in (ranks or [dist.get_rank()]) for mb in batches(r, step, dtype)]
    for j, (x, y) in enumerate(pairs):
        loss = (model(x).float() - y.float()).pow(2).mean() / len(pairs)
        if j < len(pairs) - 1:
            with grads.no_sync():
                loss.backward()
        else:
            loss.backward()
    norm = opt.step()
    opt.zero_grad()
    return norm


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def state_bytes(opt) -> int:
    tensors = list(opt.master_params) if (opt.mixed or isinstance(opt, DistributedOptimizer)) else []
    tensors += [v for s in opt.inner.state.values() for k, v in s.items() if k != "step"]
    return sum(t.numel() * t.element_size() for t in tensors)


def ulps(a: torch.Tensor, b: torch.Tensor, dtype, lr: float) -> float:
    """max |a - b| in units of the parameter dtype's rounding at max(|a|, lr): one ulp of the parameter, or of
    the AdamW update (lr x an O(1) ratio) for a parameter near zero, where the update's rounding dominates."""
    scale = torch.maximum(a.abs(), torch.full_like(a, lr))
    return ((a - b).abs() / (torch.finfo(dtype).eps * scale)).max().item()


def compare(cfg: OptimConfig, dtype, steps: int = 4, cls=torch.nn.Sequential):
    a = build(False, cfg, dtype, model=make_model(dtype, cls))
    b = build(True, cfg, dtype, model=make_model(dtype, cls))
    exact, worst, max_ulps, norms = True, 0.0, 0.0, 0.0
    for s in range(steps):
        na, nb = train_step(*a, s), train_step(*b, s)
        norms = max(norms, abs(na.item() - nb.item()) / na.item())
        pa, pb = flat(a[0]), flat(b[0])
        exact &= torch.equal(pa, pb)
        worst = max(worst, ((pa - pb).abs() / pa.abs().clamp_min(1e-3)).max().item())
        max_ulps = max(max_ulps, ulps(pa, pb, dtype, cfg.lr))
    return a, b, {"exact": exact, "max_rel": worst, "ulps": max_ulps, "norm_rel": norms}


def first_norms_exceed(cfg: OptimConfig) -> bool:
    """Whether the head's and the rest's DP-reduced gradient norms at step 0 exceed their maxes."""
    model, _, grads = build(False, cfg, model=make_model(cls=Headed))
    for j, (x, y) in enumerate(batches(dist.get_rank(), 0, torch.float32)):
        with grads.no_sync() if j == 0 else torch.enable_grad():
            ((model(x) - y).pow(2).mean() / 2).backward()
    grads.finish()
    norms = [torch.cat([p.grad.reshape(-1) for n, p in model.named_parameters() if n.startswith("3.") == head]).norm()
             for head in (True, False)]
    return bool(norms[0] > HEAD["clip_grad"] and norms[1] > cfg.clip_grad)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {}
    plain = OptimConfig(lr=1e-2, clip_grad=0.0, weight_decay=0.1)
    _, _, out["fp32_exact"] = compare(plain, torch.float32)
    _, _, out["clip"] = compare(OptimConfig(lr=1e-2, clip_grad=0.05, weight_decay=0.1), torch.float32)
    clipped = OptimConfig(lr=1e-2, clip_grad=0.05, weight_decay=0.1)
    _, _, out["clip_groups"] = compare(clipped, torch.float32, cls=Headed)
    out["clip_groups"]["bites"] = first_norms_exceed(clipped)
    a, b, out["bf16_exact"] = compare(plain, torch.bfloat16)
    out["state_bytes"] = {"plain": state_bytes(a[1]), "distributed": state_bytes(b[1]),
                          "params": sum(p.numel() for p in a[0].parameters())}

    # resume: state after step 2 into a fresh distributed optimizer and into a plain one
    ref = build(True, plain)
    for s in range(2):
        train_step(*ref, s)
    saved, weights = ref[1].state_dict(), {k: v.clone() for k, v in ref[0].state_dict().items()}
    for s in range(2, 4):
        train_step(*ref, s)
    results = {}
    for name, distributed, group in (("distributed", True, "world"), ("plain", False, "world"),
                                     ("dp1", True, None)):
        model = make_model()
        model.load_state_dict(weights)
        run = build(distributed, plain, model=model, dp_group=group)
        run[1].load_state_dict(copy.deepcopy(saved))  # torch's own load keeps CPU tensors: its steps would edit them
        for s in range(2, 4):
            train_step(*run, s, ranks=[0, 1] if group is None else None)
        results[name] = flat(run[0])
    want = flat(ref[0])
    out["resume"] = {n: torch.equal(results[n], want) for n in ("distributed", "plain")}
    out["resume_ulps"] = {n: ulps(results[n], want, torch.float32, plain.lr) for n in ("distributed", "plain")}
    out["reshard"] = {"max_abs": (results["dp1"] - want).abs().max().item(),
                      "scale": want.abs().max().item(), "exact": torch.equal(results["dp1"], want)}
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
