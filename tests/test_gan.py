"""GAN head losses and gradients against float64 closed forms; DiT feature tap; GANCritic (trunk + head)."""
import math

import pytest
import torch

from dmd2_mega.errors import ConfigError
from dmd2_mega.methods.dmd2.gan import (GANCritic, GANSettings, HeadOptions, discriminator_loss, generator_loss,
                                         holds_head, resolve_layer, saved_head_kind)
from dmd2_mega.methods.dmd2.gan_heads import build_head
from dmd2_mega.models import DataShape, build_model
from tests.utils import world_of_one


def _softplus(z):
    return math.log1p(math.exp(z))


def test_losses_and_gradients_match_closed_form():
    fake = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64, requires_grad=True)
    real = torch.tensor([1.5, -0.4], dtype=torch.float64, requires_grad=True)
    ld = discriminator_loss(fake, real)
    ref = sum(_softplus(z) for z in fake.tolist()) / 3 + sum(_softplus(-z) for z in real.tolist()) / 2
    assert ld.item() == pytest.approx(ref, rel=1e-12)
    ld.backward()
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731  d softplus / dz
    assert fake.grad.tolist() == pytest.approx([sig(z) / 3 for z in fake.tolist()], rel=1e-12)
    assert real.grad.tolist() == pytest.approx([-sig(-z) / 2 for z in real.tolist()], rel=1e-12)
    # with weights: the fake mean is over the counted rows only (the critic forward's rows in the GAN range)
    fake.grad = real.grad = None
    w = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    ld = discriminator_loss(fake, real, w)
    ref = (_softplus(0.3) + _softplus(2.0)) / 2 + sum(_softplus(-z) for z in real.tolist()) / 2
    assert ld.item() == pytest.approx(ref, rel=1e-12)
    ld.backward()
    assert fake.grad.tolist() == pytest.approx([sig(0.3) / 2, 0.0, sig(2.0) / 2], rel=1e-12)
    none = discriminator_loss(fake, real, torch.zeros(3, dtype=torch.float64))  # no counted fake: the real term
    assert none.item() == pytest.approx(sum(_softplus(-z) for z in real.tolist()) / 2, rel=1e-12)
    g = fake.detach().clone().requires_grad_(True)
    lg = generator_loss(g)
    assert lg.item() == pytest.approx(sum(_softplus(-z) for z in g.tolist()) / 3, rel=1e-12)
    lg.backward()
    assert g.grad.tolist() == pytest.approx([-sig(-z) / 3 for z in g.tolist()], rel=1e-12)


@pytest.fixture(scope="module")
def world():
    with world_of_one() as ps:
        yield ps


def _perturbed_debug_dit(seed=0):
    torch.manual_seed(seed)
    model = build_model("debug", DataShape(1, 8, num_classes=10))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def test_head_shape_and_dit_feature_tap(world):
    model = _perturbed_debug_dit()
    x, s, y = torch.randn(3, 1, 8, 8), torch.rand(3), torch.tensor([1, 2, 10])
    f = model.features(x, s, y, 0)
    # the features are block 0's output as its 4 x 4 token grid, recomputed by hand: token (i, j) at [:, :, i, j]
    tokens = x.reshape(3, 1, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(3, 16, 4)
    h = model.x_embed(tokens) + model.pos
    c = model.t_embed(s * 1000.0) + model.y_embed(y)
    out = model.blocks[0](h, c)
    assert model.feature_grid == (4, 4) and f.shape == (3, 32, 4, 4)
    for i, j in ((0, 0), (1, 3), (3, 2)):
        torch.testing.assert_close(f[:, :, i, j], out[:, 4 * i + j])
    for kind in ("conv", "mlp"):
        assert build_head(kind, 32, (4, 4), 0)(f).shape == (3,)
    # the early exit: features(layer=0) does not run the later blocks
    calls = []
    model.blocks[1].register_forward_pre_hook(lambda *_: calls.append(1))
    model.features(x, s, y, 0)
    assert calls == [], "features(layer=0) ran block 1"


def test_gan_critic_velocity_logits_and_state_keys(world):
    trunk = _perturbed_debug_dit()
    critic = GANCritic(trunk, layer=1, seed=5)
    g = torch.Generator().manual_seed(3)
    x, s, y = torch.randn(3, 1, 8, 8, generator=g), torch.rand(3, generator=g), torch.tensor([1, 2, 10])
    xg, sg, yg = torch.randn(4, 1, 8, 8, generator=g), torch.rand(4, generator=g), torch.tensor([0, 4, 10, 7])
    v_trunk = trunk(x, s, y)
    v = critic(x, s, y)
    torch.testing.assert_close(v, v_trunk, rtol=0, atol=0)  # the critic's velocity is the trunk's
    v2, fake, logits = critic(x, s, y, extra=(xg, sg, yg))
    # the extra rows share the forward's batch up to block 1 (7 rows, not 3: float32 round-off of other matmul
    # sizes), and leave the velocity as it is
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v2, v_trunk, **tol)
    # the logits on x itself come from the same forward's block-1 features: those of the truncated forward
    torch.testing.assert_close(fake, critic.head(trunk.features(x, s, y, 1)), **tol)
    assert logits.shape == (4,) and logits.dtype == torch.float32
    want = critic.head(trunk.features(xg, sg, yg, 1))  # the head on block 1's token-mean features
    torch.testing.assert_close(logits, want, **tol)
    torch.testing.assert_close(critic.logits(xg, sg, yg), want, rtol=0, atol=0)
    # the contract's one-pass form, passed through to the trunk: the same features the forward's logits read
    _, feats, extra_feats = critic.forward_features_and(x, s, y, 1, (xg, sg, yg))
    torch.testing.assert_close(critic.head(torch.cat([feats, extra_feats])), torch.cat([fake, logits]), rtol=0, atol=0)
    assert logits.abs().max() > 0
    # own=False (separate or clean fakes, all in extra): the head runs on the 4 extra rows alone, the same logits
    rows = []
    hook = critic.head.register_forward_pre_hook(lambda _, inputs: rows.append(inputs[0].shape[0]))
    v3, none, logits3 = critic(x, s, y, extra=(xg, sg, yg), own=False)
    hook.remove()
    assert none is None and rows == [4]
    torch.testing.assert_close(v3, v2, rtol=0, atol=0)
    torch.testing.assert_close(logits3, logits, **tol)
    # state dict: the trunk's keys under trunk.*, the head's under head.*
    sd = critic.state_dict()
    assert set(sd) == {f"trunk.{k}" for k in trunk.state_dict()} | {f"head.{k}" for k in critic.head.state_dict()}
    assert any(k.startswith("head.") for k in sd)
    assert holds_head(sd) and not holds_head(trunk.state_dict())
    # the head's init is keyed by the seed
    same, other = GANCritic(trunk, 1, 5).head.state_dict(), GANCritic(trunk, 1, 6).head.state_dict()
    assert all(torch.equal(w, same[k]) for k, w in critic.head.state_dict().items())
    assert not all(torch.equal(w, other[k]) for k, w in critic.head.state_dict().items())


def _wan(boundary=None, causal=None):
    from dataclasses import replace

    from dmd2_mega.models.causal import CausalLayout
    from dmd2_mega.models.family import BuildOptions
    from dmd2_mega.models.wan.family import WanFamily
    from tests.test_causal_wan import SPEC
    torch.manual_seed(4)
    spec = replace(SPEC, boundary_ratio=boundary)
    options = BuildOptions(causal=CausalLayout(2) if causal else None)
    m = WanFamily().build(spec, DataShape(4, (4, 4, 6), cond_shape=(3, 16)), options=options)
    with torch.no_grad():
        for p in m.parameters():  # nothing zero-initialised stays zero
            p.add_(0.1 * torch.randn_like(p))
    return m


@pytest.mark.parametrize("kind", ["dit", "wan", "wan-experts", "causal-wan"])
def test_forward_features_is_forward_and_features_of_one_pass(world, kind):
    """The GAN head's tap on the critic's own forward: the velocity equals forward's and the features equal the
    truncated features', exactly (the same arithmetic), for every family's model; and it is one pass."""
    g = torch.Generator().manual_seed(9)
    if kind == "dit":
        model = _perturbed_debug_dit()
        x, s, c = torch.randn(4, 1, 8, 8, generator=g), torch.rand(4, generator=g), torch.tensor([1, 2, 10, 3])
    else:
        model = _wan(boundary=0.5 if kind == "wan-experts" else None, causal=kind == "causal-wan")
        x, c = torch.randn(4, 4, 4, 4, 6, generator=g), torch.randn(4, 3, 16, generator=g)
        s = torch.tensor([0.9, 0.2, 0.7, 0.3])  # both experts' sides of boundary 0.5 in one batch
    with torch.no_grad():
        for layer in range(model.num_feature_layers):
            v, f = model.forward_features(x, s, c, layer)
            assert torch.equal(v, model(x, s, c)), f"{kind}: forward_features' velocity differs, layer {layer}"
            assert torch.equal(f, model.features(x, s, c, layer)), f"{kind}: its features differ, layer {layer}"
            assert f.shape == (4, model.feature_dim, *model.feature_grid)
    blocks = [m for n, m in model.named_modules() if n.endswith("blocks.0")]
    calls = []
    for blk in blocks:
        blk.register_forward_pre_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        model.forward_features(x, s, c, 1)
    assert len(calls) == len(blocks), "forward_features ran block 0 more than once per expert"
    with pytest.raises(IndexError, match="feature layer"):
        model.forward_features(x, s, c, model.num_feature_layers)


@pytest.mark.parametrize("kind", ["dit", "wan", "wan-experts", "causal-wan"])
def test_forward_features_and_is_forward_features_and_features(world, kind):
    """The head's real rows beside the critic's forward (`forward_features_and`): its velocity and both batches'
    features, and their gradients, equal `forward_features` on x and `features` on x' (one batch of 7 rows, not
    4 and 3: float32 round-off of other matmul sizes); the DiT and the Wan drop x' after the tapped block (0)."""
    g = torch.Generator().manual_seed(11)
    if kind == "dit":
        model = _perturbed_debug_dit()
        x, s, c = torch.randn(4, 1, 8, 8, generator=g), torch.rand(4, generator=g), torch.tensor([1, 2, 10, 3])
        extra = (torch.randn(3, 1, 8, 8, generator=g), torch.rand(3, generator=g), torch.tensor([5, 10, 0]))
    else:
        model = _wan(boundary=0.5 if kind == "wan-experts" else None, causal=kind == "causal-wan")
        x, c = torch.randn(4, 4, 4, 4, 6, generator=g), torch.randn(4, 3, 16, generator=g)
        s = torch.tensor([0.9, 0.2, 0.7, 0.3])  # both experts' sides of boundary 0.5 in one batch
        extra = (torch.randn(3, 4, 4, 4, 6, generator=g), torch.tensor([0.1, 0.8, 0.4]),
                 torch.randn(3, 3, 16, generator=g))
    weights = [torch.randn(x.shape, generator=g), torch.randn(3, model.feature_dim, *model.feature_grid, generator=g)]

    def run(joined: bool):
        model.zero_grad()
        if joined:
            v, f, fx = model.forward_features_and(x, s, c, 0, extra)
        else:
            (v, f), fx = model.forward_features(x, s, c, 0), model.features(*extra, 0)
        ((v * weights[0]).sum() + f.square().sum() + (fx * weights[1]).sum()).backward()
        return [v, f, fx], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    got, got_grads = run(True)
    want, want_grads = run(False)
    grid = (model.feature_dim, *model.feature_grid)
    assert [t.shape for t in got] == [x.shape, (4, *grid), (3, *grid)]
    for name, a, b in zip(("v", "features", "extra features"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{kind} {name}: {m}")
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 0
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    rows = {}
    for name, module in model.named_modules():
        if name.endswith(("blocks.0", f"blocks.{model.num_feature_layers - 1}")):
            module.register_forward_pre_hook(lambda mod, args, name=name: rows.setdefault(name, []).append(
                args[0].shape[0]))
    with torch.no_grad():
        model.forward_features_and(x, s, c, 0, extra)
    last = {n: r for n, r in rows.items() if not n.endswith("blocks.0")}
    if kind == "wan-experts":  # the contract's default: both batches through each expert's own passes
        assert sum(sum(r) for r in last.values()) == 4, rows
    else:  # one pass: block 0 sees the 7 rows once, the last block x's 4
        assert list(rows.values()) == [[7], [4]], rows


def test_default_feature_layer_is_the_last_of_the_first_half():
    """The head's default block: the last of the first half, so the real samples' and the actor's forwards run half
    the critic (the bottleneck of DMD2's UNet classifier); an odd count's middle block."""
    assert [resolve_layer(None, n) for n in (1, 2, 4, 5, 28, 30, 40)] == [0, 0, 1, 2, 13, 14, 19]
    assert resolve_layer(3, 4) == 3
    with pytest.raises(ConfigError, match=r"--dmd2-gan-feature-layer must be in \[0, 3\]"):
        resolve_layer(4, 4)


def test_head_options_scale_the_heads_learning_rate_only_and_survive_a_resume(world):
    """The head's own optimizer settings (`GANCritic.param_options`): its parameters in a group of their own whose
    lr is m x the schedule's; the first AdamW step (update lr * g / (|g| + eps) per element, no decay, no clip)
    moves the head m times as far as at m = 1, the trunk as far; a resumed optimizer keeps this run's multiplier;
    a saved state of another group count is refused naming the flags."""
    from dmd2_mega.config import OptimConfig
    from dmd2_mega.train.optim import LRSchedule, Optimizer

    def step(mult, **more):
        critic = GANCritic(_perturbed_debug_dit(), layer=1, seed=5,
                           head=HeadOptions(lr_mult=mult, weight_decay=0.0, clip_grad=0.0, **more))
        cfg = OptimConfig(lr=1e-3, weight_decay=0.0)
        opt = Optimizer(critic, cfg)
        LRSchedule(cfg, 10).apply(opt, 0)
        before = {n: p.detach().clone() for n, p in critic.named_parameters()}
        x, s, y = torch.randn(3, 1, 8, 8), torch.rand(3), torch.tensor([1, 2, 10])
        v, fake, real = critic(x, s, y, extra=(x.flip(0), s, y))
        # (a fake - real difference would give the last bias no gradient)
        (v.square().mean() + fake.mean() - 2 * real.mean()).backward()
        opt.step(torch.zeros(()))
        moved = {n: (p.detach() - before[n]).abs().max() for n, p in critic.named_parameters()}
        return critic, opt, moved

    _, plain, base = step(1.0)
    assert len(plain.param_groups) == 3  # the trunk's two, the head's one
    critic, opt, moved = step(10.0)
    lrs = {round(float(g["lr"]), 9) for g in opt.param_groups}
    assert lrs == {1e-3, 1e-2}, lrs
    head = {id(p) for p in critic.head.parameters()}
    for g in opt.param_groups:
        assert all((id(p) in head) == ("lr_mult" in g) for p in g["params"])
    assert all(base[n] > 0 for n in base if n.startswith("head."))  # every head parameter moved
    for n in moved:
        want = base[n] * (10.0 if n.startswith("head.") else 1.0)
        torch.testing.assert_close(moved[n], want, rtol=1e-4, atol=1e-9)
    state = opt.state_dict()
    for g in state["inner"]["param_groups"]:  # saved by a run with another multiplier: this run's stands
        g.update({"lr_mult": 3.0} if "lr_mult" in g else {})
    _, again, _ = step(10.0)
    again.load_state_dict(state)
    LRSchedule(OptimConfig(lr=1e-3), 10).apply(again, 0)
    assert {round(float(g["lr"]), 9) for g in again.param_groups} == {1e-3, 1e-2}
    state["inner"]["param_groups"] = state["inner"]["param_groups"][:2]
    with pytest.raises(ValueError, match="--dmd2-gan-head-lr-mult"):
        plain.load_state_dict(state)


def test_conv_head_is_the_references_stack_on_8x8_and_reads_the_grid():
    """On an 8 x 8 grid of 768 channels the conv head is tianweiy/DMD2's `cls_pred_branch` layer for layer; on any
    grid its logit depends on the input (no GroupNorm of one channel at 1 x 1: at 32 channels the last stage's
    groups hold 8); a video grid's frames are classified alike (permuting them leaves the logit); the same seed
    builds the same head, another seed another one, with PyTorch's default init bound 1 / sqrt(fan_in)."""
    head = build_head("conv", 768, (8, 8), 0)
    kinds = [(type(m).__name__, getattr(m, "kernel_size", None), getattr(m, "stride", None),
              getattr(m, "padding", None), getattr(m, "num_groups", None)) for m in head.net]
    assert kinds == [("Conv2d", (4, 4), (2, 2), (1, 1), None), ("GroupNorm", None, None, None, 32),
                     ("SiLU", None, None, None, None), ("Conv2d", (4, 4), (4, 4), (0, 0), None),
                     ("GroupNorm", None, None, None, 32), ("SiLU", None, None, None, None),
                     ("Conv2d", (1, 1), (1, 1), (0, 0), None)]
    assert head.net[-1].out_channels == 1
    g = torch.Generator().manual_seed(0)
    for channels, grid in ((32, (4, 4)), (32, (3, 6, 10)), (128, (2, 2))):
        head = build_head("conv", channels, grid, 1)
        x = torch.randn(6, channels, *grid, generator=g)
        logits = head(x)
        assert logits.shape == (6,) and logits.dtype == torch.float32
        assert logits.std() > 1e-2 * logits.abs().mean().clamp(min=1e-3), (channels, grid, logits)
        if len(grid) == 3:
            torch.testing.assert_close(head(x.flip(2)), logits, rtol=1e-5, atol=1e-6)
    a, b, c = (build_head("conv", 64, (8, 8), s) for s in (3, 3, 4))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.net[0].weight, c.net[0].weight)
    bound = 1 / (64 * 16) ** 0.5
    assert a.net[0].weight.abs().max() <= bound and a.net[0].weight.abs().max() > 0.9 * bound


def test_a_critic_saved_with_the_other_head_kind_names_the_flag(world):
    """A critic saved with the old MLP head, resumed by a run with the conv head (the default now), or the other way:
    the load's hint names --dmd2-gan-head and the saved kind; the same kind gives no hint."""
    trunk = _perturbed_debug_dit()
    saved = {kind: GANCritic(trunk, 1, 5, HeadOptions(kind)).state_dict() for kind in ("conv", "mlp")}
    assert {kind: saved_head_kind(state) for kind, state in saved.items()} == {"conv": "conv", "mlp": "mlp"}
    assert saved_head_kind(trunk.state_dict()) is None
    for run, other in (("conv", "mlp"), ("mlp", "conv")):
        gan = GANSettings(1.0, 1.0, True, torch.tensor([0.5]), head=HeadOptions(run))
        assert gan.load_hint("critic", saved[run]) == ""
        assert f"saved as --dmd2-gan-head {other}; this run's is {run}" in gan.load_hint("critic", saved[other])
        assert gan.load_hint("student", saved[other]) == ""
    assert "saved without the GAN head" in gan.load_hint("critic", trunk.state_dict())
