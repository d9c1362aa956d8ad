"""A model's own optimizer settings for some parameters (`param_options`: DMD2's GAN head) in train/optim.py and
train/dist_optim.py: their parameter groups (lr multiplier, weight decay), their clip group (clipped by their own
norm), the global norm returned, TP-correct group norms, the step of before without options, and checkpoints.

Kinds of equality: the clipped gradients and norms against a float64 computation within fp32 rounding (rtol 1e-6:
one fp32 norm and one multiply); without options, bit-exact against the step of before written out here (same
kernels, same order); a checkpoint round trip, exact (the groups' settings). The DP = 2 distributed-optimizer case
is in tests/mp_scripts/dist_optim_dp.py (`clip_groups`, checked by tests/test_dist_optim.py).
"""
import math

import pytest
import torch

from dmd2_mega import config
from dmd2_mega.arguments import parse_dmd2_args
from dmd2_mega.config import OptimConfig
from dmd2_mega.errors import ConfigError
from dmd2_mega.train.dist_optim import DistributedOptimizer
from dmd2_mega.train.grad_buffer import GradBuffer
from dmd2_mega.train.optim import LRSchedule, Optimizer, param_groups

EPS = 1e-6  # optim.clip_coefficient's
FLAGS = ("--dmd2-gan-head-lr-mult", "--dmd2-gan-head-weight-decay", "--dmd2-gan-head-clip-grad", "--no-load-optim")


class Toy(torch.nn.Module):
    """A trunk and a head of odd sizes, each with matrices, biases and a norm (no `param_options`)."""

    def __init__(self, dtype=torch.float32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.LayerNorm(13), torch.nn.Linear(13, 5))
        self.head = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 1))
        self.to(dtype)

    def forward(self, x):
        return self.head(self.trunk(x))


class Headed(Toy):
    """Toy whose head has options of its own."""

    def __init__(self, options: dict, dtype=torch.float32, seed=0):
        super().__init__(dtype, seed)
        self.options = options

    def param_options(self) -> dict:
        return {"head.": self.options}


def _backward(model, seed=1, n=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 7, generator=g).to(next(model.parameters()).dtype)
    (model(x).float().square().mean() * 50).backward()  # gradients of O(1): clips that bite


def _names(model, params):
    ids = {id(p): n for n, p in model.named_parameters()}
    return [ids[id(p)] for p in params]


def _groups_of_before(model, weight_decay):
    """optim.param_groups before options: [decayed matrices, the rest], in parameter order."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and not n.endswith("table.weight")]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and not n.endswith("table.weight"))]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


# ---- (a) the groups ------------------------------------------------------------------------------------------------

def test_without_options_the_groups_of_before():
    for model in (Toy(), Headed({})):  # no method; a prefix with no option
        got, want = param_groups(model, 0.1), _groups_of_before(model, 0.1)
        assert [{**g, "params": _names(model, g["params"])} for g in got] == \
            [{**g, "params": _names(model, g["params"])} for g in want]


def test_a_prefix_with_its_own_weight_decay_is_one_group_decaying_all_its_parameters():
    model = Headed({"lr_mult": 3.0, "weight_decay": 0.02, "clip_grad": 0.5})
    got = [{**g, "params": _names(model, g["params"])} for g in param_groups(model, 0.1)]
    assert got == [
        {"params": ["trunk.0.weight", "trunk.2.weight"], "weight_decay": 0.1},
        {"params": ["trunk.0.bias", "trunk.1.weight", "trunk.1.bias", "trunk.2.bias"], "weight_decay": 0.0},
        {"params": [n for n, _ in model.head.named_parameters(prefix="head")], "weight_decay": 0.02, "lr_mult": 3.0}]


def test_a_prefix_without_weight_decay_splits_like_the_rest():
    model = Headed({"lr_mult": 2.0})
    got = [{**g, "params": _names(model, g["params"])} for g in param_groups(model, 0.1)]
    assert got[2:] == [
        {"params": ["head.0.weight", "head.2.weight"], "weight_decay": 0.1, "lr_mult": 2.0},
        {"params": ["head.0.bias", "head.1.weight", "head.1.bias", "head.2.bias"], "weight_decay": 0.0,
         "lr_mult": 2.0}]
    model = Headed({"clip_grad": 1.0})
    only_clip = [{**g, "params": _names(model, g["params"])} for g in param_groups(model, 0.1)]
    assert [len(g["params"]) for g in only_clip] == [2, 4, 2, 4] and all("lr_mult" not in g for g in only_clip)


def test_an_unknown_option_is_refused_naming_the_keys():
    with pytest.raises(ValueError, match=r"unknown keys \['lr'\].*lr_mult, weight_decay, clip_grad"):
        param_groups(Headed({"lr": 2.0}), 0.1)


def test_the_prefix_decay_reaches_biases_and_norms():
    """Zero gradients: AdamW's update is the decoupled decay alone, p <- p (1 - lr wd): the head's every parameter at
    its own 0.02, the trunk's matrices at 0.1 and its biases / norms not at all."""
    model = Headed({"weight_decay": 0.02})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = Optimizer(model, OptimConfig(lr=0.5, weight_decay=0.1, clip_grad=0.0), grads=GradBuffer(model))
    opt.step()
    for n, p in model.named_parameters():
        wd = 0.02 if n.startswith("head.") else (0.1 if p.ndim >= 2 else 0.0)
        torch.testing.assert_close(p.detach(), before[n] * (1 - 0.5 * wd), rtol=1e-6, atol=0)


# ---- (b) clip groups -----------------------------------------------------------------------------------------------

def _reference_clip(grads64, c_head, c_rest):
    """float64: each group scaled by min(1, c / (||g_group|| + eps)) (c = 0: not scaled); the global norm."""
    head = [n for n in grads64 if n.startswith("head.")]
    sq = {k: sum(float(grads64[n].square().sum()) for n in names)
          for k, names in (("head", head), ("rest", [n for n in grads64 if n not in head]))}
    coef = {k: min(1.0, c / (math.sqrt(sq[k]) + EPS)) if c > 0 else 1.0
            for k, c in (("head", c_head), ("rest", c_rest))}
    out = {n: g * coef["head" if n.startswith("head.") else "rest"] for n, g in grads64.items()}
    return out, math.sqrt(sq["head"] + sq["rest"]), coef


@pytest.mark.parametrize("buffer", [True, False], ids=["gradbuffer", "dot-grad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_scale, rest_scale", [(0.3, 0.5), (2.0, 0.5), (0.0, 0.4), (0.25, 0.0)],
                         ids=["both-clip", "head-under", "head-no-clip", "rest-no-clip"])
def test_each_clip_group_is_clipped_by_its_own_norm(buffer, dtype, head_scale, rest_scale):
    """The grads the step leaves (the clipped ones: nothing zeroes them) against float64; the returned norm is the
    global one. The maxes are fractions of each group's own norm, so a clip by the global norm would miss them."""
    model = Headed({"clip_grad": 0.0}, dtype)  # the max is set below, once the norms are known
    grads = GradBuffer(model) if buffer else None
    _backward(model)
    g64 = {n: p.grad.double().clone() for n, p in model.named_parameters()}
    norms = {k: math.sqrt(sum(float(g.square().sum()) for n, g in g64.items() if n.startswith("head.") == is_head))
             for k, is_head in (("head", True), ("rest", False))}
    c_head, c_rest = head_scale * norms["head"], rest_scale * norms["rest"]
    model.options = {"clip_grad": c_head}
    opt = Optimizer(model, OptimConfig(lr=1e-3, clip_grad=c_rest), grads=grads)
    norm = opt.step()
    want, global_norm, coef = _reference_clip(g64, c_head, c_rest)
    assert (coef["head"] < 1) == (0 < head_scale < 1) and (coef["rest"] < 1) == (0 < rest_scale < 1)
    assert float(norm) == pytest.approx(global_norm, rel=1e-6)
    stepped = dict(zip(_names(model, opt.model_params), opt.master_params)) if opt.mixed else None
    for n, p in model.named_parameters():
        got = (stepped[n].grad if stepped else p.grad).double()
        torch.testing.assert_close(got, want[n], rtol=1e-6, atol=1e-12, msg=n)


# ---- (c) without options: the step of before -------------------------------------------------------------------

def _step_of_before(model, cfg, steps):
    """The optimizer step before clip groups, written out: the two groups, fused AdamW (lr a tensor, found_inf 0),
    one norm over all main_grads (without TP: the whole buffer's, one launch; the per-tensor squares of before agree
    to fp32 rounding, tests/test_optim.py), one multiply of the buffer."""
    grads = GradBuffer(model)
    groups = _groups_of_before(model, cfg.weight_decay)
    mixed = next(model.parameters()).dtype != torch.float32
    params = [p for g in groups for p in g["params"]]
    if mixed:
        masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
        for p, m in zip(params, masters):
            m.grad = p.main_grad
        it = iter(masters)
        groups = [{**g, "params": [next(it) for _ in g["params"]]} for g in groups]
    inner = torch.optim.AdamW(groups, fused=True, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    for g in inner.param_groups:
        g["lr"] = torch.full((), cfg.lr, dtype=torch.float32)
    stepped = [p for g in inner.param_groups for p in g["params"]]
    norms = []
    for s in range(steps):
        _backward(model, seed=10 + s)
        norm = torch.linalg.vector_norm(grads.buffer)
        grads.buffer.mul_(torch.clamp(cfg.clip_grad / (norm + 1e-6), max=1.0))
        inner.found_inf = torch.zeros(())
        inner.step()
        if mixed:
            with torch.no_grad():
                torch._foreach_copy_(params, stepped)
        grads.zero()
        norms.append(norm)
    return norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_without_options_bit_equal_to_the_step_of_before(dtype):
    cfg = OptimConfig(lr=1e-2, clip_grad=0.05, weight_decay=0.1)
    ref, model = Toy(dtype), Toy(dtype)
    want = _step_of_before(ref, cfg, 3)
    grads = GradBuffer(model)
    opt = Optimizer(model, cfg, grads=grads)
    for s in range(3):
        _backward(model, seed=10 + s)
        assert torch.equal(opt.step(), want[s])
        opt.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


# ---- (d) TP: a replicated parameter counted once, per clip group ---------------------------------------------------

def _fake_tp2(monkeypatch):
    """TP = 2 with a peer holding the same gradients: the TP all-reduce (SUM) doubles what it is given."""
    import torch.distributed as dist
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None, async_op=False: t.mul_(2))


@pytest.mark.parametrize("distributed", [False, True], ids=["adamw", "distributed"])
def test_group_norms_count_sharded_squares_over_tp_and_replicated_once(distributed, monkeypatch):
    """||g_k||^2 = 2 sum_sharded + sum_replicated in each group (the fake peer's shards are this rank's)."""
    model = Headed({"clip_grad": 0.0})
    sharded = {"trunk.0.weight", "trunk.0.bias", "head.0.weight"}
    for n, p in model.named_parameters():
        if n in sharded:
            p.tensor_model_parallel, p.partition_dim = True, 0
    grads = GradBuffer(model, shard=distributed)
    _backward(model)
    g64 = {n: p.grad.double().clone() for n, p in model.named_parameters()}
    sq = {k: sum(float(g.square().sum()) * (2 if n in sharded else 1) for n, g in g64.items()
                 if n.startswith("head.") == (k == "head")) for k in ("head", "rest")}
    c_head, c_rest = 0.3 * math.sqrt(sq["head"]), 0.6 * math.sqrt(sq["rest"])
    model.options = {"clip_grad": c_head}
    opt = (DistributedOptimizer if distributed else Optimizer)(model, OptimConfig(lr=1e-3, clip_grad=c_rest),
                                                               tp_group=object(), grads=grads)
    _fake_tp2(monkeypatch)
    norm = opt.step()
    assert float(norm) == pytest.approx(math.sqrt(sq["head"] + sq["rest"]), rel=1e-6)
    for n, p in model.named_parameters():
        want = g64[n] * (c_head / (math.sqrt(sq["head"]) + EPS) if n.startswith("head.") else
                         c_rest / (math.sqrt(sq["rest"]) + EPS))
        torch.testing.assert_close(p.grad.double(), want, rtol=1e-6, atol=1e-12, msg=n)


def test_distributed_optimizer_clips_its_fragments_like_the_plain_one():
    """DP = 1 (one shard: every fragment is a whole parameter): the distributed optimizer's clipped grads and norm
    equal the plain one's to fp32 rounding (other summation order); DP = 2 is in tests/test_dist_optim.py."""
    out = []
    for cls in (Optimizer, DistributedOptimizer):
        model = Headed({"clip_grad": 0.2, "lr_mult": 3.0, "weight_decay": 0.02})
        grads = GradBuffer(model, shard=cls is DistributedOptimizer)
        opt = cls(model, OptimConfig(lr=1e-2, clip_grad=0.3, weight_decay=0.1), grads=grads)
        _backward(model)
        norm = opt.step()
        out.append((norm, grads.buffer.clone(), [p.detach().clone() for p in model.parameters()]))
    (na, ga, pa), (nb, gb, pb) = out
    torch.testing.assert_close(nb, na, rtol=1e-6, atol=0)
    torch.testing.assert_close(gb, ga, rtol=1e-6, atol=1e-12)
    for a, b in zip(pa, pb):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


# ---- (f) checkpoints -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("distributed", [False, True], ids=["adamw", "distributed"])
def test_a_resume_keeps_this_runs_lr_mult_and_weight_decay(distributed):
    cls = DistributedOptimizer if distributed else Optimizer
    cfg = OptimConfig(lr=1e-2, lr_decay_style="constant")

    def built(options, weight_decay=0.1):
        model = Headed(options) if options is not None else Toy()
        return cls(model, OptimConfig(lr=1e-2, clip_grad=0.3, weight_decay=weight_decay),
                   grads=GradBuffer(model, shard=distributed)), model

    opt, model = built({"lr_mult": 3.0, "weight_decay": 0.02, "clip_grad": 0.2})
    _backward(model)
    opt.step()
    state = opt.state_dict()
    for g in state["inner"]["param_groups"]:  # as another run saved it: other multipliers and decays
        g["weight_decay"] += 0.5
        g.update({"lr_mult": 7.0} if "lr_mult" in g else {})
    again, _ = built({"lr_mult": 3.0, "weight_decay": 0.02, "clip_grad": 0.2}, weight_decay=0.2)
    again.load_state_dict(state)
    assert [(g["weight_decay"], g.get("lr_mult")) for g in again.param_groups] == \
        [(0.2, None), (0.0, None), (0.02, 3.0)]
    LRSchedule(cfg, 10).apply(again, 5)
    assert [float(g["lr"]) for g in again.param_groups] == pytest.approx([1e-2, 1e-2, 3e-2], rel=1e-6)
    plain, _ = built(None)
    with pytest.raises(ValueError, match="parameter groups") as e:
        plain.load_state_dict(state)
    assert all(flag in str(e.value) for flag in FLAGS), str(e.value)


# ---- the flags -----------------------------------------------------------------------------------------------------

def test_the_head_flags_parse_default_and_are_checked():
    base = ["--teacher-load", "t", "--dmd2-gan"]
    gan = parse_dmd2_args(base).gan
    assert (gan.head_weight_decay, gan.head_clip_grad) == (0.01, 10.0)  # tianweiy/DMD2's guidance AdamW / clip
    gan = parse_dmd2_args(base + ["--dmd2-gan-head-weight-decay", "0", "--dmd2-gan-head-clip-grad", "2.5"]).gan
    assert (gan.head_weight_decay, gan.head_clip_grad) == (0.0, 2.5)
    for flag in ("--dmd2-gan-head-weight-decay", "--dmd2-gan-head-clip-grad"):
        with pytest.raises(ConfigError, match=f"^{flag} must be >= 0, got -1"):
            parse_dmd2_args(base + [flag, "-1"])
    with pytest.raises(ConfigError, match="^--dmd2-gan-head-clip-grad needs --dmd2-gan"):
        config.GANConfig(head_clip_grad=1.0)
    with pytest.raises(ConfigError, match="^--dmd2-gan-head-weight-decay needs --dmd2-gan"):
        config.GANConfig(head_weight_decay=0.5)
