"""The DiT's LayerNorm + adaLN modulation is the fused `dmd2_kernels.adaln_modulate` (forward and backward):
every block calls it twice and the final layer once per forward, and in float64 the model's output and
every parameter gradient equal the eager path (F.layer_norm, then x * (1 + scale) + shift:
`dmd2_kernels.adaln_modulate_ref`), with all weights perturbed off the adaLN-Zero init so that shift, scale
and gates are non-zero."""
import pytest
import torch

import dmd2_kernels
from dmd2_mega.models import DataShape, build_model
from dmd2_mega.models.dit import model as dit_module
from tests.utils import world_of_one

F64 = torch.float64


@pytest.fixture(scope="module", autouse=True)
def ps():
    with world_of_one() as state:
        yield state


def perturbed_dit(cond: str) -> torch.nn.Module:
    torch.manual_seed(0)
    shape = DataShape(2, 6, num_classes=5) if cond == "labels" else DataShape(2, 6, cond_shape=(3, 7))
    model = build_model("debug", shape).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=F64))
    return model


def forward_backward(model, cond: str):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2, 6, 6, generator=g, dtype=F64)
    sigma = torch.rand(3, generator=g).float()
    c = torch.tensor([0, 4, 2]) if cond == "labels" else torch.randn(3, 3, 7, generator=g, dtype=F64)
    model.zero_grad()
    v = model(x, sigma, c)
    (v * torch.randn(v.shape, generator=g, dtype=F64)).sum().backward()
    return v.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("cond", ["labels", "embeddings"])
def test_dit_modulation_is_the_kernel_and_equals_eager_in_float64(cond, monkeypatch):
    model = perturbed_dit(cond)
    calls = []
    fused = dmd2_kernels.adaln_modulate
    monkeypatch.setattr(dmd2_kernels, "adaln_modulate", lambda *a, **k: (calls.append(1), fused(*a, **k))[1])
    v, grads = forward_backward(model, cond)
    assert len(calls) == 2 * model.spec.num_layers + 1, "the DiT does not call dmd2_kernels.adaln_modulate"
    monkeypatch.setattr(dit_module, "modulate",
                        lambda x, shift, scale, eps=1e-6: dmd2_kernels.adaln_modulate_ref(x, shift, scale, eps))
    v_ref, grads_ref = forward_backward(model, cond)
    assert len(calls) == 2 * model.spec.num_layers + 1  # the eager run did not go through the kernel
    torch.testing.assert_close(v, v_ref, rtol=1e-10, atol=1e-12)
    assert float(v.abs().max()) > 1e-2  # a real output, not the adaLN-Zero zero
    for n, gr in grads_ref.items():
        torch.testing.assert_close(grads[n], gr, rtol=1e-9, atol=1e-12, msg=lambda m: f"grad of {n}: {m}")
    assert all(float(g.abs().max()) > 0 for n, g in grads.items() if "adaln" in n)
