"""Student EMA against the closed-form recursion in float64."""
import pytest
import torch

from dmd2_mega.config import EMAConfig
from dmd2_mega.methods.ema import StudentEMA
from dmd2_mega.errors import ConfigError


def test_ema_matches_recursion_and_start_iter():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ema = StudentEMA(model, decay=0.9, start_iter=2)
    ref = model.weight.detach().double().clone()
    for it in range(1, 6):
        with torch.no_grad():
            model.weight.add_(torch.randn_like(model.weight))
        ema.update(it)
        w = model.weight.detach().double()
        ref = w.clone() if it < 2 else 0.9 * ref + 0.1 * w
        torch.testing.assert_close(ema.shadow[0].double(), ref, rtol=0, atol=1e-6)


def test_ema_state_roundtrip_and_swap():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ema = StudentEMA(model, decay=0.5)
    with torch.no_grad():
        model.weight.mul_(3)
    ema.update(1)
    other = StudentEMA(model, decay=0.5)
    other.load_state_dict(ema.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(other.shadow, ema.shadow))
    before = model.weight.detach().clone()
    x = torch.randn(4, 3)
    with ema.swapped_in(model):
        torch.testing.assert_close(model(x), torch.nn.functional.linear(x, ema.shadow[0], ema.shadow[1]))
    assert torch.equal(model.weight, before)


def test_ema_decay_and_start_iter_checked_by_ema_config():
    with pytest.raises(ConfigError, match="--ema-decay"):
        EMAConfig(decay=1.0)
    with pytest.raises(ConfigError, match="--ema-start-iter"):
        EMAConfig(decay=0.5, start_iter=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ema_bit_equal_to_per_tensor_upcast(dtype):
    """Bit-exact against the update of before: a `.float()` copy of every parameter, then one foreach lerp (or copy
    before start_iter); odd shapes, a frozen parameter left out."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 3)).to(dtype)
    model[1].weight.requires_grad_(False)
    ema = StudentEMA(model, decay=0.93, start_iter=2)
    trained = [p for p in model.parameters() if p.requires_grad]
    ref = [p.detach().float().clone() for p in trained]
    assert len(ema.shadow) == len(trained) == 5
    for it in range(1, 6):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(it)
        current = [p.detach().float() for p in trained]
        if it < 2:
            torch._foreach_copy_(ref, current)
        else:
            torch._foreach_lerp_(ref, current, 1.0 - 0.93)
        assert all(torch.equal(a, b) for a, b in zip(ema.shadow, ref)), it
