"""GAN head losses and gradients against float64 closed forms; DiT feature tap."""
import math

import pytest
import torch

from dmd2_mega.dmd2.gan import GANHead, discriminator_loss, generator_loss


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
    g = fake.detach().clone().requires_grad_(True)
    lg = generator_loss(g)
    assert lg.item() == pytest.approx(sum(_softplus(-z) for z in g.tolist()) / 3, rel=1e-12)
    lg.backward()
    assert g.grad.tolist() == pytest.approx([-sig(-z) / 3 for z in g.tolist()], rel=1e-12)


def test_head_shape_and_dit_feature_tap():
    from dmd2_mega.config import ModelConfig, ParallelConfig
    from dmd2_mega.models import DiT
    from dmd2_mega.parallel import init_distributed
    init_distributed(ParallelConfig())
    torch.manual_seed(0)
    model = DiT(ModelConfig(size="debug"), in_channels=1, image_size=8, num_classes=10)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x, s, y = torch.randn(3, 1, 8, 8), torch.rand(3), torch.tensor([1, 2, 10])
    v, f = model(x, s, y, features_at=0)
    torch.testing.assert_close(v, model(x, s, y))  # the tap does not change the output
    # the features are the token mean of block 0's output, recomputed by hand
    tokens = x.reshape(3, 1, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(3, 16, 4)
    h = model.x_embed(tokens) + model.pos
    c = model.t_embed(s) + model.y_embed(y)
    torch.testing.assert_close(f, model.blocks[0](h, c).mean(1))
    assert GANHead(model.spec.hidden_size)(f).shape == (3,)
    # the early-exit path the GAN head uses gives the same features without running later blocks
    torch.testing.assert_close(model.features(x, s, y, 0), f)
    calls = []
    model.blocks[1].register_forward_pre_hook(lambda *_: calls.append(1))
    model.features(x, s, y, 0)
    assert calls == [], "features(layer=0) ran block 1"
