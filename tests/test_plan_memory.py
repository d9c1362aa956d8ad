"""The memory planner's maths (dmd2_mega/plan/memory_plan.py, launch/plan_memory.py) against real models.

References, all independent of the planner's formulas:
  * parameters, gradients, fp32 masters, master gradients and AdamW state: the storage bytes of built
    debug / digits DiTs and wan-debug Wans (world of one) measured just before their second optimizer
    step (state materialised, grads alive), and the offload layer's own total (Sleeper.resident_bytes) - exact;
  * the TP split: each parameter's megatron `partition_dim` attribute - exact; for Wan also the shards of a
    real TP=2 build (torchrun, gloo: this file is its script) and the meta-device count of wan2.1-14b;
  * forward FLOPs: torch's FlopCounterMode with SDPA on its math path (attention as bmm) - exact (Wan at
    TP=2 too, per rank);
  * activations kept for backward: saved-tensor hooks and selective recompute's caches (unique non-parameter
    storages) - the estimate is within ACT_FACTOR either way, at each recompute granularity (none, selective, full),
    fp32 and bf16 (Wan: equal at TP 1 and 2; at CP=2 and at TP=2 with --sequence-parallel, torchrun, within 5% and
    equal with recompute; SDPA's math path, --attention-kernel math: equal in fp32, within 10% in bf16);
  * the FLOPs a backward reruns: FlopCounterMode's count of the backward less no recompute's - exact (full and
    selective; SDPA's math path, where selective cannot keep the attention, too), and the attention cores selective
    keeps = the math path's bmm FLOPs of a forward;
  * the recompute chosen per phase: Wan 2.1 1.3B at 81 x 480p on 80 and 141 GB, the printed rows the planner's, the
    chosen the least recompute that fits, --recompute-granularity forcing one for every phase;
  * the layout search: every layout valid, the first the smallest TP x CP that fits; Wan 2.1 14B at 81 x 480p
    and 81 x 720p on 64 GPUs of 80 GB fits, and its --emit-flags parse as trainer flags;
  * the rollout's pass count: the rows a real `rollout` feeds its student, averaged over seeds;
  * the phases: the method's own table (`methods.dmd2.phases.table`), the GAN head's part included; the planned
    offload set written as trainer flags parses back (the trainer's parser) to that same set; the planner's flags
    that describe the run are the trainer's (same names, defaults, help and checks).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dmd2_mega.plan import memory_plan as mp
from dmd2_mega.train.builders import build_model, cast_model
from dmd2_mega.config import ModelConfig, OptimConfig
from dmd2_mega.train.grad_buffer import GradBuffer
from dmd2_mega.methods.rollout import rollout
from dmd2_mega.flow import student_sigmas
from dmd2_mega.train.offload import Sleeper, resident_bytes
from dmd2_mega.train.dist_optim import DistributedOptimizer
from dmd2_mega.train.optim import Optimizer
from dmd2_mega.models import DataShape
from dmd2_mega.models.registry import get_spec
from dmd2_mega.models.wan import Wan, WanSpec
from dmd2_mega.distributed.parallel import tp_partition_dim
from benchmarks.plan_vs_measured import kept_bytes as measured_kept_bytes
from dmd2_mega.arguments import PLANNED, dmd2_parser, parse_dmd2_args
from dmd2_mega.methods.dmd2.phases import PHASES, table
from dmd2_mega.methods.dmd2.gan import GANCritic, HeadOptions, gan_passes, head_plan
from dmd2_mega.methods.dmd2.gan_heads import HEADS, build_head, head_parameters, head_tensors
from launch import plan_memory
from tests.utils import torchrun, world_of_one

pytestmark = pytest.mark.timeout(120)
INTEGRATION_FIXTURES = ("layout_reports",)  # fixtures that launch processes: their tests are marked integration
ACT_FACTOR = 1.25
# (size, in_channels, spatial, cond_shape): labels (10 classes) when cond_shape is None; an int spatial is a
# DiT image side (recorded as the old `image_size` data_info), a tuple Wan's (T, H, W) (as `latent_shape`)
WAN_SHAPES = [("wan-debug", 4, (3, 4, 6), (7, 16)), ("wan-debug", 4, (1, 2, 2), (1, 16)),
              ("wan-debug", 4, (5, 6, 10), (3, 16))]
# an image-to-video Wan's condition of parts (`models/wan/image.py`): text [7, 16], CLIP [5, 8], the image latent
I2V_SHAPE = ("wan-i2v-debug", 4, (3, 4, 6), (("text", (7, 16)), ("clip", (5, 8)), ("image", (4, 3, 4, 6))))
SHAPES = [("debug", 1, 8, None), ("digits", 1, 8, None), ("debug", 4, 6, (7, 12)), ("digits", 3, 12, None),
          *WAN_SHAPES, I2V_SHAPE]
WAN_14B_PARAMETERS = 14_288_491_584  # the meta-device build (test_wan_14b_count_equals_meta_build)


@pytest.fixture(scope="module")
def ps():
    with world_of_one() as state:
        yield state


def data_info(ch, spatial, cond_shape) -> dict:
    """cond_shape: None (labels), [L, D] / [D] (embeddings) or ((name, shape), ...) (a condition of parts)."""
    if cond_shape and isinstance(cond_shape[0], tuple):
        shape = DataShape(ch, spatial, cond_parts=cond_shape)
        return {"num_classes": None, "cond_shape": shape.cond_shape, "cond_parts": shape.cond_parts,
                "in_channels": ch, "latent_shape": [ch, *spatial]}
    info = {"num_classes": None if cond_shape else 10, "cond_shape": cond_shape}
    if isinstance(spatial, int):  # as checkpoints written before video data recorded images
        return {**info, "in_channels": ch, "image_size": spatial}
    return {**info, "in_channels": ch, "latent_shape": [ch, *spatial]}


def make(ps, size, ch, spatial, cond_shape, bf16=False, recompute=None):
    info = data_info(ch, spatial, cond_shape)
    model = cast_model(build_model(ModelConfig(size=size, recompute_granularity=recompute), info, ps), bf16)
    return model.train(), mp.model_shape_from_info(size, info)


def i2v_parts(image: tuple) -> tuple:
    return (("text", (512, 4096)), ("clip", (257, 1280)), ("image", image))


def batch(ms, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, ms.in_channels, *ms.spatial, generator=g)
    cond = torch.randn(n, *ms.cond_shape, generator=g) if ms.cond_shape else torch.randint(0, 10, (n,), generator=g)
    return x, torch.rand(n, generator=g), cond


def split(model) -> tuple[int, int]:
    """(TP-split, replicated) parameters of this rank's model."""
    params = list(model.parameters())
    return (sum(p.numel() for p in params if tp_partition_dim(p) is not None),
            sum(p.numel() for p in params if tp_partition_dim(p) is None))


def counted_flops(model, ms, n) -> int:
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(*batch(ms, n))
    return counter.get_total_flops()


def kept_bytes(model, ms, n) -> int:
    """Bytes of the unique non-parameter storages a training forward of n samples saves for backward."""
    return measured_kept_bytes(model, batch(ms, n))


@pytest.mark.parametrize("size,ch,img,cond_shape", SHAPES)
def test_parameter_split_matches_partition_dims(ps, size, ch, img, cond_shape):
    model, ms = make(ps, size, ch, img, cond_shape)
    counts = mp.param_counts(ms)
    assert (counts["sharded"], counts["replicated"]) == split(model)
    assert counts["tensors"] == len(list(model.parameters()))
    assert counts["buffer"] == sum(b.numel() for b in model.buffers())
    for tp in (t for t in (1, 2, 4) if ms.spec.num_heads % t == 0):
        assert mp.params_per_rank(ms, tp) == counts["sharded"] // tp + counts["replicated"]
    with pytest.raises(ValueError, match="must divide"):
        mp.params_per_rank(ms, 3)


def measured_before_each_step(model, opt, dist_opt: bool, sleeper=None) -> list:
    """A list that, before each of `opt`'s steps, gets the role's resident bytes by kind (weights and buffers, the
    fp32 main_grads, masters and Adam state; with `sleeper`, its "total" too)."""
    seen = []

    def measure(*_):
        masters = opt.master_params if opt.mixed or dist_opt else []
        state = [t for st in opt.inner.state.values() for t in st.values() if torch.is_tensor(t)]
        seen.append({"weights": resident_bytes(list(model.parameters()) + list(model.buffers())),
                     "grads": resident_bytes(p.main_grad for p in model.parameters()),
                     "optimizer": resident_bytes(list(masters) + state),
                     **({"total": sleeper.resident_bytes()} if sleeper is not None else {})})
    opt.inner.register_step_pre_hook(measure)
    return seen


@pytest.mark.parametrize("dist_opt", [False, True], ids=["adamw", "distributed"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("size,ch,img,cond_shape", SHAPES[:3] + WAN_SHAPES[:1])
def test_role_bytes_exact(ps, size, ch, img, cond_shape, bf16, dist_opt):
    """Measured resident bytes of a trained role = the planner's, with the plain and the distributed optimizer
    (at DP=1 its shard is everything: fp32 masters even for an fp32 model, one step count per parameter)."""
    model, ms = make(ps, size, ch, img, cond_shape, bf16)
    grads = GradBuffer(model, shard=dist_opt)
    cfg = OptimConfig(lr=1e-3, bf16=bf16)
    opt = (DistributedOptimizer if dist_opt else Optimizer)(model, cfg, grads=grads)
    sleeper = Sleeper("critic", [model], [opt])
    seen = measured_before_each_step(model, opt, dist_opt, sleeper)
    for step in range(2):
        x, sigma, cond = batch(ms, 3, step)
        model(x, sigma, cond).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    plan = mp.role_bytes(ms, tp=1, dp=1, bf16=bf16, trained=True, dist_opt=dist_opt)
    got = seen[-1]  # the second step: Adam state exists, grads (and master grads) are alive
    assert all(p.grad is p.main_grad for p in model.parameters())  # .grad IS the fp32 main_grad: no other grad
    for kind in ("weights", "grads", "optimizer"):
        assert got[kind] == plan[kind], f"{kind}: measured {got[kind]} B, planned {plan[kind]} B"
    assert got["total"] == sum(plan.values())
    # between phases (after zero_grad) a role still holds its grad buffer: it is persistent
    assert sleeper.resident_bytes() == sum(plan.values())
    assert mp.role_bytes(ms, 1, 1, bf16, trained=False) == {**dict.fromkeys(plan, 0), "weights": plan["weights"]}
    if dist_opt:  # DP shards the masters and moments only
        half = mp.role_bytes(ms, 1, 2, bf16, trained=True, dist_opt=True)
        assert half["optimizer"] - 4 * len(opt.master_params) == -(-(plan["optimizer"] - 4 * len(opt.master_params)) // 2)
    else:
        assert mp.role_bytes(ms, 1, 2, bf16, trained=True) == plan  # DP reduces in place: no buckets
    sleeper.close()


@pytest.mark.parametrize("dist_opt,bf16", [(False, False), (True, True)], ids=["adamw-fp32", "distributed-bf16"])
@pytest.mark.parametrize("size,ch,img,cond_shape", SHAPES[:1] + WAN_SHAPES[:1])
def test_lora_role_bytes_exact(ps, size, ch, img, cond_shape, bf16, dist_opt):
    """A LoRA role (rank 3, every target): measured adapters, their grads and optimizer state = the planner's; its
    weights are the adapters alone over a shared base, the adapters plus the base over its own copy."""
    from dmd2_mega.models import get_size
    from dmd2_mega.models.lora import adapt, lora_parameters
    model, ms = make(ps, size, ch, img, cond_shape)
    adapt(model, get_size(size).family.lora_targets, 3, 3.0, seed=0)
    model = cast_model(model, bf16)
    grads = GradBuffer(model, shard=dist_opt)
    opt = (DistributedOptimizer if dist_opt else Optimizer)(model, OptimConfig(lr=1e-3, bf16=bf16), grads=grads)
    for step in range(2):
        x, sigma, cond = batch(ms, 2, step)
        model(x, sigma, cond).float().square().mean().backward()
        opt.step()
    adapters = lora_parameters(model)
    masters = opt.master_params if opt.mixed or dist_opt else []
    state = [t for st in opt.inner.state.values() for t in st.values() if torch.is_tensor(t)]
    got = {"weights": resident_bytes(adapters), "grads": resident_bytes(p.main_grad for p in adapters),
           "optimizer": resident_bytes(list(masters) + state)}
    assert got == mp.role_bytes(ms, 1, 1, bf16, trained=True, dist_opt=dist_opt, lora_rank=3, shared=True)
    whole = resident_bytes(list(model.parameters()) + list(model.buffers()))
    assert whole == mp.role_bytes(ms, 1, 1, bf16, trained=True, dist_opt=dist_opt, lora_rank=3)["weights"]
    assert mp.lora_params(ms, 3, 1)[0] == sum(p.numel() for p in adapters)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("size,ch,img,cond_shape", SHAPES)
def test_forward_flops_match_flop_counter(ps, size, ch, img, cond_shape, n):
    model, ms = make(ps, size, ch, img, cond_shape)
    assert mp.forward_flops(ms, n) == counted_flops(model, ms, n)


@pytest.mark.parametrize("recompute", [None, "selective", "full"], ids=["no-recompute", "selective", "full"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("size,ch,img,cond_shape,n", [("debug", 1, 8, None, 5), ("digits", 1, 8, None, 64),
                                                      ("digits", 4, 16, None, 3), (*WAN_SHAPES[0], 3),
                                                      (*WAN_SHAPES[2], 2), (*I2V_SHAPE, 2)])
def test_saved_activations_within_factor(ps, size, ch, img, cond_shape, n, bf16, recompute):
    model, ms = make(ps, size, ch, img, cond_shape, bf16, recompute)
    est = mp.saved_activation_bytes(ms, n, 1, bf16, recompute)
    got = kept_bytes(model, ms, n)
    assert est / ACT_FACTOR <= got <= est * ACT_FACTOR, f"measured {got} B kept for backward, estimated {est} B"
    if ms.family.name == "wan" and not ms.cond_parts:  # text-to-video: exact (docstring of models/wan/plan.py)
        assert got == est


@pytest.mark.parametrize("size,ch,spatial,cond_shape", [("2b", 4, 32, None), ("wan2.1-14b", 16, (21, 60, 104),
                                                                               (512, 4096))])
def test_activation_estimate_scaling(size, ch, spatial, cond_shape):
    ms = mp.model_shape(size, ch, spatial, num_classes=None if cond_shape else 1000, cond_shape=cond_shape)
    a = lambda n, tp=1, **kw: mp.activation_bytes(ms, n, tp, True, grad=True, **kw)  # noqa: E731
    assert a(8) == 2 * a(4) - a(0)                             # affine in the batch (Wan: + the rope tables)
    assert a(4, recompute=True) < a(4) / 5                     # recompute keeps block inputs only
    assert a(4, recompute=True) < a(4, recompute="selective") < a(4) / 5  # selective: and the attention outputs
    assert a(4, tp=2) < a(4) and a(4, tp=8) < a(4, tp=2)       # TP splits the per-head / MLP parts
    assert mp.activation_bytes(ms, 4, 1, True, grad=False) < a(4) / 10


@pytest.mark.parametrize("size,ch,img,cond_shape", [SHAPES[0], SHAPES[2], WAN_SHAPES[0], I2V_SHAPE])
def test_recompute_flops_match_the_flop_counter(ps, size, ch, img, cond_shape):
    """The FLOPs a backward reruns = its counted FLOPs less no recompute's. The CPU's fused attention op has no FLOP
    formula, so with it only the rest is counted (selective reruns just that); on SDPA's math path (attention as
    bmm) full's count holds every block's FLOPs, and selective, which cannot keep a math-path attention, reruns as
    much. The attention cores selective keeps = that path's bmm FLOPs of a forward."""
    n = 2

    def counted(how: str, math: bool):
        model, ms = make(ps, size, ch, img, cond_shape, recompute=how)
        with sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext():
            out = model(*batch(ms, n))
            with FlopCounterMode(display=False) as counter:
                out.float().square().mean().backward()
        return counter.get_total_flops(), ms

    # (math path, granularity) -> the planner's figure the count shows: the fused op's attention is never counted
    shown = {(False, "selective"): "selective", (False, "full"): "selective", (True, "selective"): "full",
             (True, "full"): "full"}
    for math in (False, True):
        base, ms = counted("none", math)
        for how in ("selective", "full"):
            extra, want = counted(how, math)[0] - base, mp.recompute_flops(ms, n, 1, shown[(math, how)])
            assert extra == want, (how, math, extra, want)
        assert mp.recompute_flops(ms, n, 1, "selective", scores=True) == mp.recompute_flops(ms, n, 1, "full")
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        make(ps, size, ch, img, cond_shape)[0](*batch(ms, n))
    bmm = counter.get_flop_counts()["Global"][torch.ops.aten.bmm]
    assert bmm == mp.recompute_flops(ms, n, 1, "full") - mp.recompute_flops(ms, n, 1, "selective") > 0
    assert mp.recompute_flops(ms, n, 1, "none") == 0


def test_rollout_pass_count_matches_real_rollouts():
    k, b, n = 5, 8, 4
    rows = []

    def student(x, sigma, cond):
        rows.append(x.shape[0])
        return torch.zeros_like(x)
    for seed in range(200):
        rollout(student, torch.Generator().manual_seed(seed), k * b, torch.zeros(k * b, dtype=torch.long),
                student_sigmas(n), shape=(1, 2, 2), device="cpu")
    mean_f = sum(rows) / 200 / b  # sample-forwards per cycle in units of one B-sample forward
    passes = mp.cycle_passes(k, n, 1.0, "shared", recompute=False)
    assert abs(mean_f - passes["rollout"]) < 0.05 * passes["rollout"]
    assert passes == {"rollout": 12.5, "critic": 15.0, "scoring": 1.0, "actor": 3.0, "cycle": 31.5, "plain_step": 3.0}
    cfg_orig = mp.cycle_passes(k, n, 2.0, "original", recompute=True)
    assert (cfg_orig["scoring"], cfg_orig["critic"], cfg_orig["actor"], cfg_orig["plain_step"]) == (3.0, 20.0, 4.0, 4.0)


@pytest.mark.parametrize("size", ["8b", "wan2.1-14b"])
def test_plan_cycle_time_slicing(size):
    ms = (mp.model_shape(size, 4, 32, patch=2, num_classes=1000) if size == "8b"
          else mp.model_shape(size, 16, (21, 60, 104), num_classes=None, cond_shape=(512, 4096)))
    plan = mp.plan_cycle(ms, PHASES, tp=8, dp=16, micro=4, steps=5, denoise=4, bf16=True, recompute=True)
    r = plan.roles
    assert list(r) == ["student", "critic", "teacher"] and [p.name for p in PHASES] == list(mp.PHASES)
    for p in PHASES:
        phase, needed, trained = p.name, p.needs, p.trains
        sliced, full = plan.phases[(phase, True)], plan.phases[(phase, False)]
        asleep = [n for n in r if n not in needed]
        assert full["total"] - sliced["total"] == sum(sum(r[n].values()) for n in asleep)
        for n in asleep:  # a sleeping role holds nothing, its grad buffer included
            assert sliced[n] == 0
        if trained:
            assert sliced[trained] == sum(r[trained].values())
    assert mp.peak(plan, True)[1] < mp.peak(plan, False)[1]
    assert r["teacher"]["grads"] == 0 and r["critic"]["grads"] == 4 * mp.params_per_rank(ms, 8)


def test_cli_reports_measured_role_bytes(ps, capsys):
    model, ms = make(ps, "digits", 1, 8, None)
    weights = resident_bytes(list(model.parameters()) + list(model.buffers()))
    assert plan_memory.main(["--model-size", "digits", "--image-size", "8", "--in-channels", "1",
                             "--num-classes", "10", "--micro-batch-size", "64"]) == 0
    out = capsys.readouterr().out
    teacher = next(line for line in out.splitlines() if line.startswith("teacher "))
    assert teacher.split()[1:3] == plan_memory.fmt_bytes(weights).split()
    assert "peak time-sliced" in out and "peak all resident" in out
    assert plan_memory.main(["--model-size", "8b", "--tensor-model-parallel-size", "8", "--data-parallel-size", "16",
                             "--bf16", "--recompute-granularity", "full", "--gpu-memory-gib", "10"]) == 0
    out = capsys.readouterr().out
    assert "per rank at TP=8" in out and "DP=16 (128 GPUs)" in out and "does NOT fit in 10 GiB" in out


def test_cli_rejects_tp_that_does_not_divide_heads(capsys):
    assert plan_memory.main(["--model-size", "8b", "--tensor-model-parallel-size", "3"]) == 1
    assert capsys.readouterr().err == "ConfigError: --tensor-model-parallel-size 3 must divide the 32 heads\n"


# ---- the Wan family -------------------------------------------------------------------------------

def test_wan_14b_count_equals_meta_build(ps):
    spec = get_spec("wan2.1-14b")
    with torch.device("meta"):  # no memory: the shapes only
        model = Wan(spec, DataShape(16, (1, 2, 2), cond_shape=(512, 4096)))
    ms = mp.model_shape("wan2.1-14b", 16, (1, 2, 2), num_classes=None, cond_shape=(512, 4096))
    counts = mp.param_counts(ms)
    assert (counts["sharded"], counts["replicated"]) == split(model)
    assert counts["sharded"] + counts["replicated"] == WAN_14B_PARAMETERS
    assert counts["tensors"] == len(list(model.parameters())) and counts["buffer"] == 512 * 4096
    i2v = mp.param_counts(mp.model_shape_from_info("wan2.1-i2v-14b-480p", {  # the I2V form: its K/V, CLIP embedder
        "num_classes": None, "latent_shape": [16, 1, 2, 2], "cond_parts": i2v_parts((16, 1, 2, 2))}))
    with torch.device("meta"):
        model = Wan(get_spec("wan2.1-i2v-14b-480p"), DataShape(16, (1, 2, 2), cond_parts=i2v_parts((16, 1, 2, 2))))
    assert (i2v["sharded"], i2v["replicated"]) == split(model) and i2v["tensors"] == len(list(model.parameters()))
    assert mp.params_per_rank(ms, 8) == counts["sharded"] // 8 + counts["replicated"]
    for tp in (3, 16):  # 40 heads
        with pytest.raises(ValueError, match=f"size {tp} must divide the 40 heads"):
            mp.params_per_rank(ms, tp)


# (TP, CP, SP) of the torchrun reports: TP=2 (the per-rank maths is exact), CP=2 and TP=2 with SP (estimates)
LAYOUTS = {"tp2": (2, 1, False), "cp2": (1, 2, False), "tp2sp": (2, 1, True)}


def layout_report(out_dir: str) -> None:
    """Under torchrun with 2 ranks (test_wan_layout_per_rank_maths): for each of LAYOUTS in turn (megatron-core's
    groups rebuilt between them), this rank's parameter split, forward FLOPs and bytes kept for backward of the
    Wan shapes, fp32 and bf16, at each recompute granularity, in out_dir/<layout>_rank<r>.json."""
    from megatron.core import parallel_state as mpu
    from dmd2_mega.config import ParallelConfig
    from dmd2_mega.distributed.parallel import destroy_distributed, init_distributed
    for name, (tp, cp, sp) in LAYOUTS.items():
        ps = init_distributed(ParallelConfig(tp, cp, sp))
        report = {}
        for i, shape in enumerate((WAN_SHAPES[0], WAN_SHAPES[2])):
            for bf16 in (False, True):
                for recompute in (None, "selective", "full"):
                    model, ms = make(ps, *shape, bf16, recompute)
                    key = f"{i} {'bf16' if bf16 else 'fp32'} {recompute}"
                    report[key] = {"split": split(model), "kept": kept_bytes(model, ms, 3),
                                   "flops": counted_flops(model, ms, 3) if i == 0 and recompute is None else None}
        with open(os.path.join(out_dir, f"{name}_rank{ps.rank}.json"), "w") as f:
            json.dump(report, f)
        mpu.destroy_model_parallel()
    destroy_distributed()


@pytest.fixture(scope="module")
def layout_reports(tmp_path_factory):
    d = tmp_path_factory.mktemp("layouts")
    torchrun(2, __file__, ["--layout-report", d], timeout=300).check("wan-debug at TP=2, CP=2, TP=2 + SP")
    return d


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_wan_layout_per_rank_maths(layout_reports, name):
    """TP=2: shards, FLOPs and kept bytes exactly the per-rank maths. CP=2 and TP=2 with SP (18- and 75-token
    grids, the second padded): the kept bytes within 5% of the estimate (selective too), with full recompute
    exactly."""
    tp, cp, sp = LAYOUTS[name]
    for rank in (0, 1):
        report = json.load(open(layout_reports / f"{name}_rank{rank}.json"))
        for key, got in report.items():
            i, kind, recompute = key.split()
            shape = (WAN_SHAPES[0], WAN_SHAPES[2])[int(i)]
            ms = mp.model_shape_from_info(shape[0], data_info(*shape[1:]))
            counts = mp.param_counts(ms)
            assert got["split"] == [counts["sharded"] // tp, counts["replicated"]]
            if got["flops"] is not None and name == "tp2":
                assert got["flops"] == mp.forward_flops(ms, 3, tp=2) < mp.forward_flops(ms, 3, tp=1), key
            how = None if recompute == "None" else recompute
            est = mp.saved_activation_bytes(ms, 3, tp, kind == "bf16", how, cp=cp, sp=sp)
            if name == "tp2" or recompute == "full":
                assert got["kept"] == est, (name, rank, key, got["kept"], est)
            else:
                assert abs(got["kept"] - est) <= 0.05 * got["kept"], (name, rank, key, got["kept"], est)
            if cp > 1 or sp:
                assert got["kept"] < mp.saved_activation_bytes(ms, 3, tp, kind == "bf16", how)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_math_attention_scores(ps, bf16):
    """--attention-kernel math: SDPA's math path keeps the probabilities; fp32 exact, bf16 within 10%."""
    for shape in (WAN_SHAPES[0], WAN_SHAPES[2]):
        model, ms = make(ps, *shape, bf16)
        with sdpa_kernel(SDPBackend.MATH):
            got = kept_bytes(model, ms, 3)
        est = mp.saved_activation_bytes(ms, 3, 1, bf16, scores=True)
        assert est > mp.saved_activation_bytes(ms, 3, 1, bf16)
        if bf16:
            assert abs(got - est) <= 0.1 * got, (shape, got, est)
        else:
            assert got == est, (shape, got, est)


def test_wan_config_json_without_cross_attn_norm(ps, tmp_path, capsys):
    """A diffusers folder (`--model-size DIR`): 3 heads, patch (1, 1, 2), no cross-attention norm."""
    spec = WanSpec(name="x", num_heads=3, head_dim=6, num_layers=2, ffn_dim=30, in_channels=4, out_channels=4,
                   text_dim=10, freq_dim=8, patch_size=(1, 1, 2), cross_attn_norm=False)
    (tmp_path / "config.json").write_text(json.dumps(spec.diffusers_config()))
    model, ms = make(ps, str(tmp_path), 4, (2, 3, 4), (5, 10))
    counts = mp.param_counts(ms)
    assert (ms.family.name, ms.tokens, ms.text_len) == ("wan", 2 * 3 * 2, 5)
    assert (counts["sharded"], counts["replicated"], counts["tensors"]) == (*split(model), len(list(model.parameters())))
    assert mp.forward_flops(ms, 2) == counted_flops(model, ms, 2)
    assert kept_bytes(model, ms, 2) == mp.saved_activation_bytes(ms, 2, 1, False)
    weights = resident_bytes(list(model.parameters()) + list(model.buffers()))
    assert plan_memory.main(["--model-size", str(tmp_path), "--latent-shape", "4", "2", "3", "4",
                             "--text-len", "5", "--micro-batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "(Wan): hidden 18, 2 layers, 3 heads, FFN 30, patch 1x1x2; latents 4x2x3x4 -> 12 tokens, text 5 x 10" in out
    teacher = next(line for line in out.splitlines() if line.startswith("teacher "))
    assert teacher.split()[1:3] == plan_memory.fmt_bytes(weights).split()


def test_model_shape_from_info():
    old = {"in_channels": 4, "image_size": 32, "num_classes": 1000, "cond_shape": None}
    new = {**old, "latent_shape": [4, 32, 32]}
    want = mp.model_shape("2b", 4, 32, num_classes=1000)
    assert mp.model_shape_from_info("2b", old) == mp.model_shape_from_info("2b", new) == want
    text = {"in_channels": 4, "latent_shape": [4, 32, 32], "num_classes": 10, "cond_shape": [7, 12]}
    assert mp.model_shape_from_info("2b", text) == mp.model_shape("2b", 4, 32, num_classes=None, cond_shape=(7, 12))
    video = {"in_channels": 16, "latent_shape": [16, 21, 60, 104], "num_classes": None, "cond_shape": [512, 4096]}
    ms = mp.model_shape_from_info("wan2.1-14b", video)
    assert (ms.family.name, ms.spatial, ms.tokens, ms.text_len, ms.sample_numel) == (
        "wan", (21, 60, 104), 21 * 30 * 52, 512, 16 * 21 * 60 * 104)
    with pytest.raises(ValueError, match="latent height 61 is not a multiple of the patch size 2"):
        mp.model_shape_from_info("wan2.1-14b", {**video, "latent_shape": [16, 21, 61, 104]})
    with pytest.raises(ValueError, match="takes text embeddings"):
        mp.model_shape_from_info("wan2.1-14b", {**video, "num_classes": 10, "cond_shape": None})
    with pytest.raises(ValueError, match="takes square images"):
        mp.model_shape_from_info("2b", video)


def test_cli_wan_14b_acceptance_row(capsys):
    row = ["--model-size", "wan2.1-14b", "--latent-shape", "16", "21", "60", "104", "--text-len", "512",
           "--tensor-model-parallel-size", "8", "--data-parallel-size", "1", "--micro-batch-size", "1", "--bf16"]
    assert plan_memory.main(row) == 0
    out = capsys.readouterr().out
    assert "latents 16x21x60x104 -> 32760 tokens, text 512 x 4096" in out
    assert "parameters 14.288 B in all" in out and "per rank at TP=8" in out
    # without the flag the planner chooses: no recompute does not fit (~150 GiB activations), selective does
    assert "applied to every phase: selective" in out
    assert "(critic phase) -> fits in 80 GiB" in out.split("peak time-sliced")[1].splitlines()[0]
    assert plan_memory.main(row + ["--recompute-granularity", "none"]) == 0
    assert "does NOT fit in 80 GiB" in capsys.readouterr().out.split("peak time-sliced")[1].splitlines()[0]
    assert plan_memory.main(row + ["--recompute-granularity", "full"]) == 0
    out = capsys.readouterr().out
    assert "(critic phase) -> fits in 80 GiB" in out.split("peak time-sliced")[1].splitlines()[0]
    assert "does NOT fit in 80 GiB" in out.split("peak all resident")[1].splitlines()[0]


WAN_13B_480P = ["--model-size", "wan2.1-1.3b", "--latent-shape", "16", "21", "60", "104", "--text-len", "512",
                "--micro-batch-size", "1", "--bf16", "--dmd2-critic-steps-per-rollout", "5"]


def recompute_rows(out: str) -> dict:
    """The printed recompute table: {(phase, granularity): (activations, phase bytes, extra FLOPs %, fits, chosen)}."""
    lines = out.split("recompute per phase with grad")[1].splitlines()[3:]
    rows = {}
    for line in lines[:len(mp.GRAD_PHASES) * 3]:
        c = line.split()
        rows[(c[0], c[1])] = (" ".join(c[2:4]), " ".join(c[4:6]), float(c[6][1:-1]), c[7] == "yes",
                              c[8:] == ["chosen"])
    return rows


@pytest.mark.parametrize("gb,want", [(80, "selective"), (141, "none")])
def test_cli_chooses_recompute_per_phase_for_wan_13b(capsys, gb, want):
    """Wan 2.1 1.3B at 81 x 480p (32,760 tokens, text 512), B=1, K=5, TP=1: each phase takes the least recompute
    whose time-sliced phase fits 0.9 x the GPU; the printed rows are the planner's; selective reruns ~30% of what
    full does (the attention cores, ~70% of a block, are kept)."""
    assert plan_memory.main(WAN_13B_480P + ["--gpu-memory-gb", str(gb)]) == 0
    out = capsys.readouterr().out
    rows = recompute_rows(out)
    ms = mp.model_shape("wan2.1-1.3b", 16, (21, 60, 104), num_classes=None, cond_shape=(512, 4096))
    budget = mp.PLAN_HEADROOM * gb * 2 ** 30
    options = mp.recompute_options(ms, PHASES, budget, tp=1, dp=1, micro=1, steps=5, denoise=4, bf16=True)
    chosen = mp.choose_recompute(options)
    for phase, opts in options.items():
        for o in opts:
            fmt = plan_memory.fmt_bytes
            assert rows[(phase, o.granularity)] == (fmt(o.activations), fmt(o.total), round(100 * o.share, 1), o.fits,
                                                    o is chosen[phase])
        none, sel, full = opts
        assert none.extra_flops == 0 < sel.extra_flops and 0.25 < sel.extra_flops / full.extra_flops < 0.35
        assert full.total < sel.total < none.total
        c = chosen[phase]
        assert c.granularity == want and c.fits and c.total <= budget
        assert not any(o.fits for o in opts[:opts.index(c)])  # every less recomputing choice is over the budget
    assert f"applied to every phase: {want}; flags --recompute-granularity {want}" in out
    assert f"recompute {want} (chosen per phase, below)" in out
    assert "fits in" in out.split("peak time-sliced")[1].splitlines()[0]


def test_cli_recompute_flag_forces_every_phase(capsys):
    """--recompute-granularity given: that granularity in every phase, fitting or not (the table says which)."""
    for gb, how, fits in ((141, "full", True), (80, "none", False)):
        assert plan_memory.main(WAN_13B_480P + ["--gpu-memory-gb", str(gb), "--recompute-granularity", how]) == 0
        out = capsys.readouterr().out
        chosen = {k: v for k, v in recompute_rows(out).items() if v[4]}
        assert sorted(chosen) == [("actor", how), ("critic", how)] and {v[3] for v in chosen.values()} == {fits}
        assert f"recompute {how} (--recompute-granularity)" in out and "(--recompute-granularity: every phase" in out


def test_choose_recompute_falls_back_to_full_and_applies_the_most():
    opt = lambda phase, g, fits: mp.RecomputeOption(phase, g, 0, 0, 0, 1, fits)  # noqa: E731
    options = {"critic": [opt("critic", g, g == "full") for g in mp.GRANULARITIES],
               "actor": [opt("actor", g, True) for g in mp.GRANULARITIES]}
    chosen = mp.choose_recompute(options)
    assert (chosen["critic"].granularity, chosen["actor"].granularity) == ("full", "none")
    assert mp.applied_recompute(chosen) == "full"
    options["critic"] = [opt("critic", g, False) for g in mp.GRANULARITIES]  # nothing fits: full, marked so
    critic = mp.choose_recompute(options)["critic"]
    assert (critic.granularity, critic.fits) == ("full", False)
    assert {o.granularity for o in mp.choose_recompute(options, forced="selective").values()} == {"selective"}


def test_cli_wan_14b_lora_fits_where_full_weights_do_not(capsys):
    """Wan 2.1 14B at 480p, B=1, bf16, CFG 5: full weights need 8 GPUs of 80 GB, LoRA roles (rank 64) over the
    teacher's shared weights fit on one."""
    row = ["--model-size", "wan2.1-14b", "--latent-shape", "16", "21", "60", "104", "--text-len", "512",
           "--micro-batch-size", "1", "--bf16", "--dmd2-teacher-guidance-scale", "5", "--search", "--gpus-per-node",
           "8", "--gpu-memory-gb", "80"]
    lora = ["--student-lora-rank", "64", "--critic-lora-rank", "64"]
    assert plan_memory.main(row + ["--world-size", "4"]) == 1
    assert "no layout of 4 GPUs fits 80 GiB" in capsys.readouterr().err
    assert plan_memory.main(row + ["--world-size", "8"]) == 0
    assert "chosen: TP=4 CP=1 DP=2 SP" in capsys.readouterr().out
    assert plan_memory.main(row + ["--world-size", "1"] + lora) == 0
    out = capsys.readouterr().out
    assert "chosen: TP=1 CP=1 DP=1, recompute full, time-sliced none" in out
    assert "student (LoRA r=64, the teacher's weights shared)" in out and "nothing is time-sliced" in out
    assert "(critic phase) -> fits in 80 GiB" in out.split("peak all resident")[1].splitlines()[0]


@pytest.mark.parametrize("flags,error", [
    (["--latent-shape", "16", "21", "60", "104", "--tensor-model-parallel-size", "16"],
     "--tensor-model-parallel-size 16 must divide the 40 heads"),
    ([], "--model-size wan2.1-14b (Wan) takes video latents: give --latent-shape C T H W"),
    (["--latent-shape", "16", "21", "60", "103"], "latent width 103 is not a multiple of the patch size 2"),
    (["--latent-shape", "4", "21", "60", "104"], "the data's latents have 4 channels, but --model-size wan2.1-14b "
                                                   "takes in_channels 16"),
    (["--latent-shape", "16", "60", "104"], "--model-size wan2.1-14b (Wan) takes video latents"),
    (["--latent-shape", "16", "21", "60", "104", "--cond-shape", "7", "4096"], "give --text-len L, not --cond-shape"),
    (["--latent-shape", "16", "21", "60", "104", "--patch", "2"], "--patch applies to the DiT"),
    (["--latent-shape", "16", "21", "60", "104", "--text-len", "0"], "--text-len must be >= 1, got 0"),
])
def test_cli_wan_errors_are_one_line(capsys, flags, error):
    assert plan_memory.main(["--model-size", "wan2.1-14b", *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ConfigError: ") and err.count("\n") == 1 and error in err, err


def test_cli_dit_flags_keep_working(capsys):
    assert plan_memory.main(["--model-size", "2b", "--latent-shape", "4", "32", "32"]) == 0
    by_shape = capsys.readouterr().out
    assert plan_memory.main(["--model-size", "2b", "--in-channels", "4", "--image-size", "32"]) == 0
    assert capsys.readouterr().out == by_shape
    assert plan_memory.main(["--model-size", "2b", "--text-len", "7"]) == 1
    assert "--text-len is for Wan" in capsys.readouterr().err
    assert plan_memory.main(["--model-size", "no-such-size"]) == 1
    assert "--model-size 'no-such-size' is unknown" in capsys.readouterr().err


def test_cycle_summary_and_acceptance_on_model_timings():
    k, n, b, F = 5, 4, 64, 10.0  # timings that follow the cost model exactly (ms)
    p = mp.cycle_passes(k, n, 1.0, "shared", recompute=False)
    t = {"cycle": p["cycle"] * F, "cycle_offload": 1.02 * p["cycle"] * F, "phases": p["cycle"] * F,
         "in_rollout": p["rollout"] * F, "plain": p["plain_step"] * F, "F": F, "F_KB": k * F, "gap": F, "critic_fwd": F}
    s = mp.cycle_summary(t, p, k=k, b=b, drawn=p["rollout"], flops_per_sample=1000, peak_tflops=2e-5)
    assert s["overhead ratio (cycle / sum of phases)"] == 1.0
    assert s["cycle / analytic minimum"] == pytest.approx(1.0)
    assert s["cycle without rollout / its analytic minimum"] == pytest.approx(1.0)
    assert s["analytic TFLOP/s (model FLOPs)"] == pytest.approx(1000 * b * p["cycle"] / (p["cycle"] * F * 1e-3) / 1e12)
    assert s["MFU %"] == pytest.approx(100 * s["analytic TFLOP/s (model FLOPs)"] / 2e-5)
    mem = [["rollout", 30, 14, 14], ["critic", 38, 24, 24], ["actor", 38, 19, 19]]  # MiB: off, on, own roles
    assert all(ok for _, _, ok in mp.acceptance(s, mem, persistent=30))
    slow = mp.cycle_summary({**t, "cycle": 1.2 * t["cycle"], "gap": 3 * F}, p, k=k, b=b, drawn=p["rollout"],
                            flops_per_sample=1000)
    leaky = [["rollout", 30, 20, 14], ["critic", 29, 24, 24], ["actor", 38, 19, 19]]  # a role not slept; one missing
    assert [ok for _, _, ok in mp.acceptance(slow, leaky, persistent=30)] == [False, False, False, True, False]
    assert [ok for _, _, ok in mp.acceptance(s, [["r", 30, 27, 14]], persistent=30)][3] is False  # 27 > 1.1 x 14


def test_the_analytic_minimum_costs_the_steps_at_the_measured_plain_step():
    """A model whose backward costs 1.5F (plain step 2.5F): a cycle of exactly its passes at those costs is at its
    minimum (ratio 1), though in nominal plain steps (3F) it reads 1.07x; a cycle 10% slower reads 1.1x."""
    k, n, b, F, plain = 5, 4, 64, 10.0, 2.5
    p = mp.cycle_passes(k, n, 1.25, "shared", recompute=False)
    drawn = 12.3  # the rollout's drawn stop steps, not the expected 12.5
    cycle = (drawn + p["scoring"] + (k + 1) * plain) * F
    t = {"cycle": cycle, "cycle_offload": cycle, "phases": cycle, "in_rollout": drawn * F, "plain": plain * F,
         "F": F, "F_KB": k * F, "gap": F, "critic_fwd": F}
    s = mp.cycle_summary(t, p, k=k, b=b, drawn=drawn, flops_per_sample=1000)
    assert s["plain step in F (measured)"] == pytest.approx(plain)
    assert s["analytic minimum in plain steps"] == pytest.approx((drawn + 2.0) / plain + k + 1)
    assert s["cycle / analytic minimum"] == pytest.approx(1.0)
    assert s["cycle without rollout / its analytic minimum"] == pytest.approx(1.0)
    assert s["cycle in plain steps"] / s["nominal minimum (backward as the cost model)"] > 1.05
    slow = mp.cycle_summary({**t, "cycle": 1.1 * cycle}, p, k=k, b=b, drawn=drawn, flops_per_sample=1000)
    assert slow["cycle / analytic minimum"] == pytest.approx(1.1)


def test_model_flops_leave_recomputed_forwards_out():
    """MFU counts model FLOPs: with full recompute the same cycle time gives the same TFLOP/s as without
    (the K + 1 extra forwards of recompute are hardware work, not model work)."""
    k, n, b, F = 5, 4, 64, 10.0
    plain, rec = (mp.cycle_passes(k, n, 1.0, "shared", recompute=r) for r in (False, True))
    assert rec["cycle"] - plain["cycle"] == k + 1
    t = {"cycle": 400.0, "cycle_offload": 400.0, "phases": 400.0, "in_rollout": 100.0, "plain": 30.0, "F": F,
         "F_KB": k * F, "gap": F, "critic_fwd": F}
    a, r = (mp.cycle_summary(t, p, k=k, b=b, drawn=p["rollout"], flops_per_sample=1000) for p in (plain, rec))
    assert r["analytic TFLOP/s (model FLOPs)"] == pytest.approx(a["analytic TFLOP/s (model FLOPs)"], rel=1e-12)
    assert a["analytic TFLOP/s (model FLOPs)"] == pytest.approx(1000 * b * plain["cycle"] / 0.4 / 1e12)


# ---- the offload default: the cheapest set of roles that makes every phase fit ---------------------

def test_choose_offload_picks_the_cheapest_fitting_set():
    ms = mp.model_shape("2b", 4, 32, patch=2, num_classes=1000)
    plan = mp.plan_cycle(ms, PHASES, tp=1, dp=1, micro=4, steps=2, denoise=4, bf16=True, recompute=True)
    names = ["student", "critic", "teacher"]
    subsets = [frozenset(n for i, n in enumerate(names) if mask >> i & 1) for mask in range(8)]
    peaks = {s: max(mp.phase_bytes(plan, s).values()) for s in subsets}
    moved = {s: sum(sum(plan.roles[r].values()) * (1 if r == "teacher" else 2) for r in s) for s in subsets}
    everything, every_role = peaks[frozenset()], subsets[-1]
    assert mp.choose_offload(plan, everything)[::2] == (frozenset(), True)  # all fits: nothing sleeps
    # the critic phase (critic + teacher) is the peak: the teacher alone cannot lower it, the student can
    assert peaks[frozenset(["teacher"])] == everything and peaks[frozenset(["student"])] < everything
    assert mp.choose_offload(plan, peaks[frozenset(["student"])])[0] == frozenset(["student"])
    for budget in sorted(set(peaks.values())):
        roles, totals, fits = mp.choose_offload(plan, budget)
        assert fits and max(totals.values()) == peaks[roles] <= budget
        assert all(peaks[s] > budget for s in subsets if moved[s] < moved[roles]), (budget, roles)
    roles, _, fits = mp.choose_offload(plan, min(peaks.values()) - 1)
    assert (roles, fits) == (every_role, False)
    # "every role offloaded" is the time-sliced plan; the GAN head's table adds the critic's weights to the actor
    # phase (only while the critic sleeps: resident, it is there whole anyway)
    assert mp.phase_bytes(plan, every_role) == {p: plan.phases[(p, True)]["total"] for p in mp.PHASES}
    gan = mp.plan_cycle(ms, table(gan=True), tp=1, dp=1, micro=4, steps=2, denoise=4, bf16=True, recompute=True)
    assert gan.roles == plan.roles and gan.activations == plan.activations
    for roles in subsets:
        extra = {p: mp.phase_bytes(gan, roles)[p] - mp.phase_bytes(plan, roles)[p] for p in mp.PHASES}
        assert extra == {"rollout": 0, "critic": 0,
                         "actor": plan.roles["critic"]["weights"] if "critic" in roles else 0}, roles
    assert gan.phases[("actor", True)]["critic"] == plan.roles["critic"]["weights"]


def test_search_layouts_order_and_validity():
    ms = mp.model_shape("wan-digits", 1, (16, 32, 32), num_classes=None, cond_shape=(4, 16))
    kw = dict(world=8, gpus_per_node=4, micro=2, steps=2, denoise=4, bf16=True)
    roomy = mp.search_layouts(ms, PHASES, budget=2 ** 40, **kw)
    every_role = frozenset(["student", "critic", "teacher"])
    assert roomy[0][0] == mp.Layout(1, 1, 8, False, frozenset(), every_role)  # everything fits: pure DP
    for lay, plan, totals, fits in roomy:
        assert lay.tp * lay.cp * lay.dp == 8 and ms.spec.num_heads % (lay.tp * lay.cp) == 0 and 4 % lay.tp == 0
        assert fits and lay.dist_opt == (lay.dp * lay.cp > 1) and lay.sp == (lay.tp > 1)
    # a budget only split layouts meet: the first that fits has the smallest TP x CP of those that fit
    budget = 0.9 * max(roomy[0][2].values())
    tight = mp.search_layouts(ms, PHASES, budget=budget, **kw)
    fitting = [f for f in tight if f[3]]
    assert tight[0][3] and tight[0][0].tp * tight[0][0].cp == min(f[0].tp * f[0].cp for f in fitting)
    assert max(tight[0][2].values()) <= budget
    assert not mp.search_layouts(ms, PHASES, budget=1.0, **kw)[0][3]  # nothing fits one byte: the first says so


@pytest.mark.parametrize("latent,tokens", [(["16", "21", "60", "104"], 32760), (["16", "21", "90", "160"], 75600)],
                         ids=["480p", "720p"])
def test_cli_search_wan_14b_fits_80gb(capsys, latent, tokens):
    row = ["--model-size", "wan2.1-14b", "--latent-shape", *latent, "--text-len", "512", "--micro-batch-size", "1",
           "--bf16", "--dmd2-teacher-guidance-scale", "5", "--world-size", "64", "--gpus-per-node", "8", "--search"]
    assert plan_memory.main(row) == 0
    out = capsys.readouterr().out
    assert f"-> {tokens} tokens" in out and "chosen: TP=" in out
    assert "fits in 80 GiB" in out.split("peak time-sliced")[1].splitlines()[0]
    assert plan_memory.main(row + ["--emit-flags"]) == 0
    flags = capsys.readouterr().out.split()
    cfg = parse_dmd2_args(["--teacher-load", "t", *flags])
    p = cfg.parallel
    assert 64 % (p.tensor_model_parallel_size * p.context_parallel_size) == 0
    assert p.sequence_parallel == (p.tensor_model_parallel_size > 1) and cfg.optim.use_distributed_optimizer


def test_search_layouts_of_a_dit_take_no_sequence_parallelism():
    """The DiT family runs with TP and DP only: no layout of it has CP > 1 or SP, and its flags parse."""
    ms = mp.model_shape("600m", 4, (32, 32), num_classes=1000, cond_shape=None)
    found = mp.search_layouts(ms, PHASES, world=16, gpus_per_node=8, budget=3 * 2 ** 30, micro=8, steps=5, denoise=4,
                              bf16=True)
    assert {f[0].cp for f in found} == {1} and any(f[0].tp > 1 for f in found)
    assert not any(f[0].sp for f in found) and found[0][3]
    cfg = parse_dmd2_args(["--teacher-load", "t", *found[0][0].flags()])
    assert not cfg.parallel.sequence_parallel


def test_cli_search_errors(capsys):
    base = ["--model-size", "wan2.1-14b", "--latent-shape", "16", "21", "60", "104", "--bf16"]
    assert plan_memory.main(base + ["--search"]) == 1
    assert "--search needs --world-size" in capsys.readouterr().err
    assert plan_memory.main(base + ["--world-size", "8", "--search", "--gpu-memory-gb", "16"]) == 1
    assert "no layout of 8 GPUs fits 16 GiB per GPU" in capsys.readouterr().err
    assert plan_memory.main(base + ["--emit-flags"]) == 1
    assert "add --search" in capsys.readouterr().err


def test_distributed_optimizer_shards_over_dp_times_cp():
    ms = mp.model_shape("wan-debug", 4, (3, 4, 6), num_classes=None, cond_shape=(7, 16))
    kw = dict(tp=1, micro=1, steps=2, denoise=4, bf16=True, dist_opt=True)
    assert (mp.plan_cycle(ms, PHASES, dp=2, cp=2, **kw).roles["student"]
            == mp.role_bytes(ms, 1, 4, True, trained=True, dist_opt=True))


# ---- one flag set: the planner's flags are the trainer's; its offload choice survives the flags -------------

EVERY_ROLE = ("student", "critic", "teacher")


@pytest.mark.parametrize("mask", range(8))
def test_layout_flags_parse_to_the_planned_subset(mask):
    """Every subset of roles a plan can time-slice, written by `Layout.flags`, is the set the trainer's parser
    (and `DMD2Config.offload_set`, what the trainer's start-up uses) gives back."""
    planned = frozenset(r for i, r in enumerate(EVERY_ROLE) if mask >> i & 1)
    how = mp.GRANULARITIES[mask % 3]
    flags = mp.Layout(2, 1, 4, how, planned, frozenset(EVERY_ROLE)).flags()
    cfg = parse_dmd2_args(["--teacher-load", "t", *flags])
    assert cfg.dmd2.offload_set(EVERY_ROLE) == planned, flags
    assert (cfg.model.recompute_granularity or "none") == how, flags
    assert ("--offload-inactive" in flags) == (planned == frozenset(EVERY_ROLE))
    assert ("--no-offload-inactive" in flags) == (not planned)
    assert ("--offload-roles" in flags) == (0 < len(planned) < 3)


def test_search_emits_a_planned_subset_the_trainer_keeps(capsys):
    """Wan 2.1 14B on 64 x 80 GB: the plan keeps the frozen teacher resident and time-slices the two trained roles;
    --emit-flags says so (it used to write --offload-inactive, which sleeps the teacher too)."""
    row = ["--model-size", "wan2.1-14b", "--latent-shape", "16", "21", "60", "104", "--text-len", "512",
           "--micro-batch-size", "1", "--bf16", "--dmd2-teacher-guidance-scale", "5", "--world-size", "64",
           "--search"]
    ms = mp.model_shape("wan2.1-14b", 16, (21, 60, 104), num_classes=None, cond_shape=(512, 4096))
    best = mp.search_layouts(ms, PHASES, world=64, gpus_per_node=8, budget=mp.PLAN_HEADROOM * 80 * 2 ** 30, micro=1,
                             steps=5, denoise=4, bf16=True, guidance=5.0)[0][0]
    assert best.offload == frozenset(["student", "critic"])
    assert plan_memory.main(row + ["--emit-flags"]) == 0
    flags = capsys.readouterr().out.split()
    assert flags == best.flags() and flags[-2:] == ["--offload-roles", "critic,student"]
    assert parse_dmd2_args(["--teacher-load", "t", *flags]).dmd2.offload_set(EVERY_ROLE) == best.offload


def test_planner_flags_are_the_trainers():
    """Each flag of `arguments.PLANNED` is the same argparse action in the planner and in pretrain_dmd2.py (name,
    destination, default, type, help), --help shows them, and the planner's defaults are the trainer's."""
    planner, trainer = plan_memory.parser(), dmd2_parser()
    help_text = planner.format_help()
    fields = ("dest", "default", "type", "nargs", "const", "help", "metavar", "choices")
    for flag in PLANNED:
        mine, theirs = planner._option_string_actions[flag], trainer._option_string_actions[flag]
        assert type(mine) is type(theirs) and all(getattr(mine, f) == getattr(theirs, f) for f in fields), flag
        assert flag in help_text
    for flag in ("--model-size", "--micro-batch-size", "--dmd2-critic-steps-per-rollout", "--dmd2-gan",
                 "--recompute-granularity", "--use-distributed-optimizer", "--gpu-memory-gb"):
        assert flag in PLANNED
    run, cfg = plan_memory.parse_args([]).run, parse_dmd2_args(["--teacher-load", "t"])
    for part in ("model", "parallel", "optim", "train", "gan"):
        assert getattr(run, part) == getattr(cfg, part), part
    assert run.dmd2 == dataclasses.replace(cfg.dmd2, teacher_load=None)  # the planner reads no checkpoint


def test_cli_gan_head_keeps_the_critic_weights_in_the_actor_phase(capsys):
    """--dmd2-gan: the planner reads DMD2's table with the GAN head's part (the actor phase holds the critic's
    weights while the critic is time-sliced)."""
    row = ["--model-size", "2b", "--latent-shape", "4", "32", "32", "--micro-batch-size", "4", "--bf16"]
    cells = {}
    for gan in (False, True):
        assert plan_memory.main(row + ["--dmd2-gan"] * gan) == 0
        out = capsys.readouterr().out
        assert f"GAN head {'on' if gan else 'off'}" in out
        actor = next(line for line in out.splitlines() if line.startswith("actor    time-sliced"))
        cells[gan] = actor.split()[4:6]  # after the student's number and unit: the critic's ("0" and the next cell)
    ms = mp.model_shape("2b", 4, 32, num_classes=1000)
    head = head_plan(plan_memory.parse_args(row + ["--dmd2-gan"]).run.gan, ms)  # the critic holds the GAN head too
    weights = mp.plan_cycle(ms, table(gan=True), tp=1, dp=1, micro=4, steps=5, denoise=4, bf16=True,
                            added=head).roles
    assert cells[False][0] == "0" and cells[True] == plan_memory.fmt_bytes(weights["critic"]["weights"]).split()


# ---- the GAN head's parameters on the critic (`plan_cycle`'s `added`) -------------------------------------------

HEAD_GRIDS = [(4, 4), (8, 8), (5, 9), (1, 7), (3, 4, 6), (1, 3, 17), (21, 30, 52), (21, 60, 104)]


@pytest.mark.parametrize("kind", HEADS)
@pytest.mark.parametrize("grid", HEAD_GRIDS, ids=lambda g: "x".join(map(str, g)))
def test_head_parameters_match_the_built_head(kind, grid):
    """The analytic count = the built head's, parameters and tensors; a 480p Wan's grids at 16 channels (a 1536-wide
    head there takes seconds and ~1 GB to build), the channels' part checked at the digits DiT's 128 on a small
    grid. The stages of the large grids are the ones a 1.3B Wan's 1536-wide head has."""
    for channels in (16, 128) if len(grid) == 2 and max(grid) <= 8 else (16,):
        head = build_head(kind, channels, grid, 0)
        assert head_parameters(kind, channels, grid) == sum(p.numel() for p in head.parameters())
        assert head_tensors(kind, grid) == len(list(head.parameters()))
    assert head_parameters("conv", 1536, (21, 30, 52)) == 4 * (16 * 1536 ** 2 + 3 * 1536) + 3 * 1536 ** 2 + 3 * 1536 \
        + 1536 + 1  # 30 x 52 -> 15 x 26 -> 7 x 13 -> 3 x 6 -> 1 x 3 (k4 s2 p1), then a (1, 3) kernel, then 1 x 1
    with pytest.raises(ValueError, match="--dmd2-gan-head must be one of"):
        head_parameters("attn", 16, grid)


@pytest.mark.parametrize("dist_opt", [False, True], ids=["adamw", "distributed"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", HEADS)
def test_gan_critic_role_bytes_exact(ps, kind, bf16, dist_opt):
    """A GANCritic as the trainer builds it (the head wrapped on, then the whole cast under --bf16) measured before
    its second step = `role_bytes` with the head's parameters added (`head_plan`)."""
    from dmd2_mega.config import GANConfig
    model, ms = make(ps, "debug", 1, 8, None)
    model = cast_model(GANCritic(model, 1, seed=3, head=HeadOptions(kind)), bf16)
    grads = GradBuffer(model, shard=dist_opt)
    opt = (DistributedOptimizer if dist_opt else Optimizer)(model, OptimConfig(lr=1e-3, bf16=bf16), grads=grads)
    seen = measured_before_each_step(model, opt, dist_opt)
    for step in range(2):
        x, sigma, cond = batch(ms, 3, step)
        (model(x, sigma, cond).float().square().mean() + model.logits(x, sigma, cond).square().mean()).backward()
        opt.step()
        opt.zero_grad()
    (params, tensors), = head_plan(GANConfig(enabled=True, head=kind), ms).values()
    assert (params, tensors) == (sum(p.numel() for p in model.head.parameters()), len(list(model.head.parameters())))
    assert seen[-1] == mp.role_bytes(ms, 1, 1, bf16, trained=True, dist_opt=dist_opt, added_params=params,
                                     added_tensors=tensors)
    assert head_plan(GANConfig(), ms) == {}


@pytest.mark.parametrize("dist_opt", [False, True], ids=["adamw", "distributed"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_plan_cycle_adds_the_head_to_the_critic_only(bf16, dist_opt):
    """`added` {critic: (P, T)}: the critic's bytes grow by exactly P at the weights' width, 4P of grads and 12P
    (bf16: masters + moments) or 8P (fp32) of optimizer state, / DP with the distributed optimizer, + 4T of steps; in
    every phase it is resident; the other roles and the activations do not change; the searches pass it on."""
    ms = mp.model_shape("wan2.1-1.3b", 16, (21, 60, 104), num_classes=None, cond_shape=(512, 4096))
    P, T = head_parameters("conv", 1536, (21, 30, 52)), head_tensors("conv", (21, 30, 52))
    dp = 4 if dist_opt else 1  # 12 P / 4 is exact for any P
    kw = dict(tp=2, dp=dp, micro=1, steps=5, denoise=4, bf16=bf16, recompute=True, dist_opt=dist_opt)
    plain = mp.plan_cycle(ms, table(gan=True), **kw)
    gan = mp.plan_cycle(ms, table(gan=True), added={"critic": (P, T)}, **kw)
    state = (3 * P if dist_opt else (12 if bf16 else 8) * P) + 4 * T
    want = {"weights": (2 if bf16 else 4) * P, "grads": 4 * P, "optimizer": state}
    assert {k: gan.roles["critic"][k] - plain.roles["critic"][k] for k in want} == want
    assert {r: gan.roles[r] for r in ("student", "teacher")} == {r: plain.roles[r] for r in ("student", "teacher")}
    assert gan.activations == plain.activations
    for key, row in gan.phases.items():
        held = row["critic"] - plain.phases[key]["critic"]
        assert row["total"] - plain.phases[key]["total"] == held in (0, want["weights"], sum(want.values())), key
    assert mp.plan_cycle(ms, table(gan=True), added={"critic": P}, **kw).roles["critic"]["optimizer"] \
        == gan.roles["critic"]["optimizer"] - 4 * T  # an int: parameters alone
    with pytest.raises(ValueError, match="not a role of the phase table"):
        mp.plan_cycle(ms, table(gan=True), added={"actor": P}, **kw)
    options = mp.recompute_options(ms, table(gan=True), 2 ** 40, added={"critic": (P, T)}, **{
        k: v for k, v in kw.items() if k != "recompute"})
    assert options["critic"][2].total == gan.phases[("critic", True)]["total"]


def test_search_layouts_count_the_head():
    ms = mp.model_shape("wan-digits", 1, (16, 32, 32), num_classes=None, cond_shape=(4, 16))
    kw = dict(world=4, gpus_per_node=4, budget=2 ** 40, micro=2, steps=2, denoise=4, bf16=True)
    added = {"critic": (head_parameters("conv", 64, (16, 16, 16)), head_tensors("conv", (16, 16, 16)))}
    plain, gan = mp.search_layouts(ms, table(gan=True), **kw), mp.search_layouts(ms, table(gan=True), added=added, **kw)
    assert [f[0] for f in plain] == [f[0] for f in gan]
    for (lay, p, _, _), (_, g, _, _) in zip(plain, gan):
        assert g.roles["critic"]["weights"] - p.roles["critic"]["weights"] == 2 * added["critic"][0], lay


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_cli_gan_head_on_the_critic(capsys, bf16):
    """--dmd2-gan: the critic's row grows by the head's bytes (weights at the model's width, fp32 grads, AdamW state
    with fp32 masters under --bf16, a step count per tensor), the other rows stay, and the first line says so."""
    row = ["--model-size", "digits", "--image-size", "8", "--in-channels", "1", "--num-classes", "10",
           "--micro-batch-size", "64"] + ["--bf16"] * bf16
    lines = {}
    for gan in (False, True):
        assert plan_memory.main(row + ["--dmd2-gan"] * gan) == 0
        lines[gan] = capsys.readouterr().out.splitlines()
    P, T = head_parameters("conv", 128, (4, 4)), head_tensors("conv", (4, 4))
    assert f"GAN head on (conv, {plan_memory.fmt_count(P)} params on the critic)" in lines[True][1]
    assert "GAN head off" in lines[False][1]
    ms = plan_memory.shape_from_args(plan_memory.parse_args(row))
    critic = sum(mp.role_bytes(ms, 1, 1, bf16, trained=True).values())
    head = P * ((2 if bf16 else 4) + 4 + (12 if bf16 else 8)) + 4 * T

    def role_row(out, role):  # the per-role table's row (not the phase table's "critic" rows): its total last
        at = out.index("per-rank bytes of each role (AdamW):")
        return next(line for line in out[at:out.index("", at)] if line.startswith(role + " "))
    got = {gan: role_row(lines[gan], "critic").split()[-2:] for gan in (False, True)}
    assert got[False] == plan_memory.fmt_bytes(critic).split()
    assert got[True] == plan_memory.fmt_bytes(critic + head).split()
    assert role_row(lines[True], "critic").startswith("critic + GAN head")
    for role in ("student", "teacher"):
        assert role_row(lines[True], role).split() == role_row(lines[False], role).split()


def test_plan_offload_counts_the_head():
    """The trainer's offload choice (`DMD2Method.plan_offload`) plans the GAN head's parameters on the critic and its
    forwards' activations: at a budget the headless plan meets with nothing asleep, the head's plan must
    time-slice."""
    from types import SimpleNamespace
    from dmd2_mega.methods.dmd2.method import DMD2Method
    cfg = parse_dmd2_args(["--teacher-load", "t", "--model-size", "digits", "--micro-batch-size", "4", "--dmd2-gan"])
    info = data_info(1, 8, None)
    ps_ = SimpleNamespace(tp_size=1, dp_size=1, cp_size=1, sequence_parallel=False)
    method = SimpleNamespace(phases=table(gan=True), student_sigmas=torch.zeros(4))
    ms = mp.model_shape_from_info("digits", info)
    kw = dict(tp=1, dp=1, micro=4, steps=cfg.dmd2.critic_steps_per_rollout, denoise=4, bf16=False,
              guidance=cfg.dmd2.teacher_guidance_scale)
    plain = mp.plan_cycle(ms, table(gan=True), **kw)
    budget = max(mp.phase_bytes(plain, ()).values())
    assert mp.choose_offload(plain, budget)[0] == frozenset()
    roles, totals, fits = DMD2Method.plan_offload(method, cfg, ps_, info, budget)
    gan = mp.plan_cycle(ms, table(gan=True), added=head_plan(cfg.gan, ms), passes=gan_passes(cfg.gan, ms, 4), **kw)
    assert (roles, totals, fits) == mp.choose_offload(gan, budget) and roles and fits


if __name__ == "__main__":  # torchrun's script for test_wan_layout_per_rank_maths
    layout_report(sys.argv[sys.argv.index("--layout-report") + 1])
