"""Self-Forcing's autoregressive rollout (issue 30, the rollout; dmd2_mega/methods/self_forcing/rollout.py) against a
float64 per-sample transcription of Self-Forcing's loop written here: each sample alone, with its own KV cache, runs
each chunk's schedule exactly up to its exit step (no batch, no masking), keeps x, sigma and x0 there, re-noises x0 to
the context level and writes the chunk to its cache. Exit steps per chunk (Self-Forcing's) and per sample, a context
level 0 and > 0, a rolling window; the generators are consumed independently of the exit steps.
"""
import pytest
import torch

from dmd2_mega.errors import RolloutError
from dmd2_mega.methods.self_forcing.rollout import causal_rollout
from dmd2_mega.models import DataShape
from dmd2_mega.models.causal import CausalLayout
from dmd2_mega.models.wan.family import WanFamily
from tests.test_causal_wan import SPEC, causal
from tests.utils import world_of_one

pytestmark = pytest.mark.timeout(300)
SIGMAS = torch.tensor([1.0, 0.7, 0.4])  # fp32, as every sigma the models take
SHAPE = (4, 5, 4, 6)  # C, F, H, W: chunks of 2 frames are [1, 2, 2]


@pytest.fixture(scope="module")
def world():
    with world_of_one() as ps:
        yield ps


def transcription(model, cond, sigmas, exits, eps, ctx_eps, context_noise):
    """Self-Forcing's loop, one sample at a time (module docstring); exits [n, chunks], eps [N, n, *video]."""
    n, chunks = exits.shape
    spans = model.causal_layout.chunks(SHAPE[1])
    x_all, x0_all, ctx_all = (torch.zeros((n, *SHAPE), dtype=torch.float64) for _ in range(3))
    for j in range(n):
        cache = model.new_cache()
        for c, (a, b) in enumerate(spans):
            x = eps[0][j:j + 1, :, a:b]
            for i in range(int(exits[j, c]) + 1):
                s = float(sigmas[i])
                x0 = x - s * model.stream_forward(x, torch.tensor([s]), cond[j:j + 1], cache)
                if i < exits[j, c]:
                    x = (1 - float(sigmas[i + 1])) * x0 + float(sigmas[i + 1]) * eps[i + 1][j:j + 1, :, a:b]
            ctx = x0 if ctx_eps is None else (1 - context_noise) * x0 + context_noise * ctx_eps[j:j + 1, :, a:b]
            model.stream_forward(ctx, torch.tensor([context_noise]), cond[j:j + 1], cache, write=True)
            x_all[j, :, a:b], x0_all[j, :, a:b], ctx_all[j, :, a:b] = x[0], x0[0], ctx[0]
    return x_all, x0_all, ctx_all


@pytest.mark.parametrize("per_chunk", [True, False], ids=["exit-per-chunk", "exit-per-sample"])
@pytest.mark.parametrize("context_noise", [0.0, 0.3])
@pytest.mark.parametrize("layout", [CausalLayout(2), CausalLayout(1, window=2, sink=1)], ids=["chunk2", "window"])
def test_rollout_equals_the_per_sample_loop(world, per_chunk, context_noise, layout):
    model = causal(SHAPE[1], layout, dtype=torch.float64)
    n = 3
    cond = torch.randn(n, 3, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = causal_rollout(model, torch.Generator().manual_seed(7), torch.Generator().manual_seed(8), cond, SIGMAS,
                         shape=SHAPE, context_noise=context_noise, per_chunk=per_chunk, dtype=torch.float64)
    chunks = len(layout.chunks(SHAPE[1]))
    stop = torch.Generator().manual_seed(8)  # the same draws, in the documented order
    exits = (torch.randint(0, 3, (chunks,), generator=stop).expand(n, chunks) if per_chunk
             else torch.randint(0, 3, (n, chunks), generator=stop))
    g = torch.Generator().manual_seed(7)
    eps = [torch.randn((n, *SHAPE), generator=g, dtype=torch.float64) for _ in range(3)]
    ctx_eps = torch.randn((n, *SHAPE), generator=g, dtype=torch.float64) if context_noise > 0 else None
    x, x0, ctx = transcription(model, cond, SIGMAS, exits, eps, ctx_eps, context_noise)
    assert torch.equal(got.exit_step.cpu(), exits)
    assert torch.equal(got.sigma, SIGMAS[exits])
    for name, a, b in (("x", got.x, x), ("x0hat", got.x0hat, x0), ("context", got.context, ctx)):
        assert float((a - b).abs().max()) <= 1e-10 * float(b.abs().max()), name
    if not per_chunk:
        assert any(len(set(col)) > 1 for col in exits.T.tolist()), "no chunk whose samples exit at different steps"


def test_the_noise_stream_does_not_depend_on_the_exit_steps(world):
    model = causal(SHAPE[1], CausalLayout(2))
    cond = torch.randn(2, 3, 16)
    states = []
    for stop_seed in (1, 2, 3):
        g = torch.Generator().manual_seed(5)
        causal_rollout(model, g, torch.Generator().manual_seed(stop_seed), cond, SIGMAS, shape=SHAPE)
        states.append(g.get_state())
    assert all(torch.equal(s, states[0]) for s in states)


def test_a_bidirectional_model_cannot_roll_out_causally(world):
    bi = WanFamily().build(SPEC, DataShape(4, SHAPE[1:], cond_shape=(3, 16)))
    with pytest.raises(RolloutError, match="needs a causal student"):
        causal_rollout(bi, torch.Generator(), torch.Generator(), torch.zeros(1, 3, 16), SIGMAS, shape=SHAPE)
