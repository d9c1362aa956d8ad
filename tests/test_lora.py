"""LoRA adapters on the tensor-parallel linears (issue 31 item 1; `models/lora.py`, `linears.AdaptableLinear`).

a. In one process: with B = 0 an adapted Wan / DiT gives its base's output bit for bit (forward and the input's
   gradient); A is PEFT's default draw, the same matrix whatever the order of the modules; the adapter's delta is
   s (x A^T) B^T against a float64 transcription; only the family's targets are adapted, with a clear error for a
   name no linear has and for transformer-engine linears.
b. Under torchrun (tests/mp_scripts/lora_parallel.py): the output, loss and every adapter's gradient at TP = 2
   (column and row bases), TP = 2 with SP, CP = 2 and TP = 2 x CP = 2 with SP equal TP = 1 (fp32, 1e-5 relative).
"""
import math
import os
from types import SimpleNamespace

import pytest
import torch

from dmd2_mega.errors import ConfigError
from dmd2_mega.models import build_model
from dmd2_mega.models.dit.family import DiTFamily
from dmd2_mega.models.lora import LoRA, attach_lora, lora_parameters
from dmd2_mega.models.wan import Wan
from dmd2_mega.models.wan.family import WanFamily
from tests.mp_scripts.lora_parallel import DIT_SHAPE, perturb
from tests.mp_scripts.wan_token_parallel import SHAPE, SPEC, inputs
from tests.test_token_parallel import assert_same
from tests.utils import MP_SCRIPTS, torchrun, world_of_one

pytestmark = pytest.mark.timeout(600)
INTEGRATION_FIXTURES = ("runs",)


@pytest.fixture(scope="module")
def world():
    with world_of_one() as ps:
        yield ps


def wan():
    torch.manual_seed(0)
    model = Wan(SPEC, SHAPE)
    perturb(model, SimpleNamespace(tp_size=1, tp_rank=0))  # the zero-init output projection would stop gradients
    return model


def test_a_zero_b_gives_the_base_bit_for_bit(world):
    base, adapted = wan(), wan()
    names = attach_lora(adapted, WanFamily.lora_targets, rank=4, alpha=8.0, seed=1)
    assert len(names) == SPEC.num_layers * 10  # attn1 / attn2 q, k, v, out and fc1, fc2 per block
    x, sigma, cond, target = inputs()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_a, out_b = base(xa, sigma, cond), adapted(xb, sigma, cond)
    assert torch.equal(out_a, out_b)
    ((out_a - target) ** 2).mean().backward()
    ((out_b - target) ** 2).mean().backward()
    assert torch.allclose(xa.grad, xb.grad, rtol=1e-6, atol=1e-9)
    # the adapters are the model's only new parameters; B's gradient flows (A's waits for B to move)
    assert {n for n, _ in adapted.named_parameters()} - {n for n, _ in base.named_parameters()} == {
        n for n, _ in adapted.named_parameters() if ".lora." in n}
    assert all(m.B.grad is not None and float(m.B.grad.abs().max()) > 0 for m in adapted.modules()
               if isinstance(m, LoRA))
    dit_base, dit = (build_model("debug", DIT_SHAPE) for _ in range(2))
    perturb(dit_base, SimpleNamespace(tp_size=1, tp_rank=0))  # adaLN-zero would make every block the identity
    dit.load_state_dict(dit_base.state_dict())
    attach_lora(dit, DiTFamily.lora_targets, rank=2, alpha=2.0, seed=1)
    xd = torch.randn(2, *DIT_SHAPE.sample_shape)
    args = (xd, torch.tensor([0.3, 0.6]), torch.tensor([2, 5]))
    assert torch.equal(dit_base(*args), dit(*args))


def test_the_delta_is_the_low_rank_product_and_a_is_pefts_draw(world):
    model = wan()
    attach_lora(model, ("to_q", "fc2"), rank=3, alpha=6.0, seed=2)
    lins = {n: m for n, m in model.named_modules() if isinstance(getattr(m, "lora", None), LoRA)}
    assert sorted({n.rsplit(".", 1)[-1] for n in lins}) == ["fc2", "to_q"]
    lin = lins["blocks.0.attn1.to_q"]
    torch.nn.init.normal_(lin.lora.B)
    x = torch.randn(2, 5, SPEC.hidden_size)
    w, b, a, bb = (t.detach().double() for t in (lin.weight, lin.bias, lin.lora.A, lin.lora.B))
    want = x.double() @ w.T + b + 2.0 * (x.double() @ a.T) @ bb.T
    assert torch.allclose(lin(x).double(), want, rtol=1e-5, atol=1e-6)
    fc2 = lins["blocks.1.fc2"]
    assert fc2.lora.A.shape == (3, SPEC.ffn_dim) and fc2.lora.B.shape == (SPEC.hidden_size, 3)
    assert float(fc2.lora.B.abs().max()) == 0
    bound = 1 / math.sqrt(SPEC.ffn_dim)
    assert float(fc2.lora.A.abs().max()) <= bound and float(fc2.lora.A.std()) > 0.4 * bound  # U(-b, b): std b/sqrt3
    again = wan()  # the same draw by name, whatever else is adapted (and in which order)
    attach_lora(again, ("fc2",), rank=3, alpha=6.0, seed=2)
    assert torch.equal(dict(again.named_modules())["blocks.1.fc2"].lora.A, fc2.lora.A)
    assert len(lora_parameters(model)) == 2 * len(lins)


def test_bad_targets_and_transformer_engine_are_refused(world):
    with pytest.raises(ConfigError, match=r"no linear of the model is named like a LoRA target of \['nope'\]"):
        attach_lora(wan(), ("nope",), rank=2, alpha=2.0, seed=0)
    lin = wan().blocks[0].fc1
    lin.impl = "transformer_engine"
    with pytest.raises(ConfigError, match="give --transformer-impl local"):
        lin.attach(LoRA("column", 4, 4, 2, 2.0, torch.Generator()))
    with pytest.raises(ConfigError, match="rank must be >= 1"):
        LoRA("row", 4, 4, 0, 2.0, torch.Generator())


# ---- b. TP / SP / CP == TP = 1 ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_parallel")
    script = os.path.join(MP_SCRIPTS, "lora_parallel.py")
    torchrun(2, script, ["--out", d, "ref:1:1:0", "tp2:2:1:0", "tp2sp:2:1:1", "cp2:1:2:0"]).check("2 ranks")
    torchrun(4, script, ["--out", d, "all:2:2:1"]).check("4 ranks")
    return {n: torch.load(d / f"{n}.pt") for n in ("ref-wan", "ref-dit", "tp2-wan", "tp2-dit", "tp2sp-wan",
                                                      "cp2-wan", "all-wan")}


@pytest.mark.integration
@pytest.mark.parametrize("layout", ["tp2-wan", "tp2-dit", "tp2sp-wan", "cp2-wan", "all-wan"])
def test_adapter_gradients_at_every_layout_equal_tp1(runs, layout):
    got, want = runs[layout], runs["ref-" + layout.split("-")[1]]
    assert want["grads"] and all(".lora." in n for n in want["grads"])  # the adapters alone are trained
    assert_same({"feats": got["out"], **got}, {"feats": want["out"], **want}, 1e-5, f"{layout} vs TP=1")
