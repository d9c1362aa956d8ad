"""Self-Forcing's autoregressive rollout (issue 30, the rollout; dmd2_mega/methods/self_forcing/rollout.py) against a
float64 per-sample transcription of Self-Forcing's loop written here: each sample alone, with its own KV cache, runs
each chunk's schedule exactly up to its exit step (no batch, no masking), keeps x, sigma and x0 there, re-noises x0 to
the context level and writes the chunk to its cache. Exit steps per chunk (Self-Forcing's) and per sample, a context
level 0 and > 0, a rolling window; the generators are consumed independently of the exit steps.
The actor's gradient path (`replay`): it reproduces the rollout's video, its weight gradient equals that of a rollout
that keeps its graph (written here, float64), and a chunk's gradient comes from its own exit forward only.
"""
import pytest
import torch

from dmd2_mega.errors import RolloutError
from dmd2_mega.methods.self_forcing.rollout import causal_rollout, draw_exits, draw_window, replay, window_starts
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


@pytest.mark.parametrize("per_chunk", [True, False], ids=["exit-per-chunk", "exit-per-sample"])
def test_exits_drawn_ahead_are_the_rollouts_own(world, per_chunk):
    """A cycle draws each micro-batch's exits (then its window) from its stop generator before any rollout and hands
    them in (`exits`): the rollout and the generators' states are bit-equal to the rollout drawing its own."""
    model = causal(SHAPE[1], CausalLayout(2), dtype=torch.float64)
    n = 3
    cond = torch.randn(n, 3, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    spans = model.causal_layout.chunks(SHAPE[1])
    own_stop = torch.Generator().manual_seed(8)
    own = causal_rollout(model, torch.Generator().manual_seed(7), own_stop, cond, SIGMAS, shape=SHAPE,
                         per_chunk=per_chunk, dtype=torch.float64)
    own_window = draw_window(spans, 2, own_stop)  # windows of 2 frames start at chunk 1 or 2: a draw
    stop = torch.Generator().manual_seed(8)
    host = draw_exits(stop, n, len(spans), len(SIGMAS), per_chunk)
    window = draw_window(spans, 2, stop)
    got = causal_rollout(model, torch.Generator().manual_seed(7), None, cond, SIGMAS, shape=SHAPE,
                         per_chunk=per_chunk, dtype=torch.float64, exits=(host, host.contiguous()))
    assert window == own_window and torch.equal(stop.get_state(), own_stop.get_state())
    for name in ("x", "sigma", "x0hat", "context", "cond", "exit_step", "sample_id"):
        assert torch.equal(getattr(got, name), getattr(own, name)), name
    with pytest.raises(RolloutError, match="exit steps drawn for"):
        causal_rollout(model, torch.Generator(), None, cond[:2], SIGMAS, shape=SHAPE, exits=(host, host))


def test_a_bidirectional_model_cannot_roll_out_causally(world):
    bi = WanFamily().build(SPEC, DataShape(4, SHAPE[1:], cond_shape=(3, 16)))
    with pytest.raises(RolloutError, match="needs a causal student"):
        causal_rollout(bi, torch.Generator(), torch.Generator(), torch.zeros(1, 3, 16), SIGMAS, shape=SHAPE)


# ---- the actor's gradient path: replay ----------------------------------------------------------------------

def graph_rollout(model, cond, exits, eps):
    """The rollout that keeps its graph, written here (per-chunk exits): the steps before each chunk's exit and the
    cache writes without grad, the exit step with grad. Returns the video x0 with its graph."""
    n = cond.shape[0]
    cache, out = model.new_cache(), []
    for c, (a, b) in enumerate(model.causal_layout.chunks(SHAPE[1])):
        x = eps[0][:, :, a:b]
        e = int(exits[0, c])
        for i in range(e):
            with torch.no_grad():
                s = float(SIGMAS[i])
                x0 = x - s * model.stream_forward(x, SIGMAS[i].expand(n), cond, cache)
                x = (1 - float(SIGMAS[i + 1])) * x0 + float(SIGMAS[i + 1]) * eps[i + 1][:, :, a:b]
        x0 = x - float(SIGMAS[e]) * model.stream_forward(x, SIGMAS[e].expand(n), cond, cache)  # with grad
        out.append(x0)
        with torch.no_grad():
            model.stream_forward(x0.detach(), torch.zeros(n), cond, cache, write=True)
    return torch.cat(out, 2)


def grads(model, video, weight):
    model.zero_grad()
    (video * weight).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_replay_is_the_rollout_and_its_gradient_the_graph_keeping_rollouts(world):
    model = causal(SHAPE[1], CausalLayout(2), dtype=torch.float64)
    n = 2
    cond = torch.randn(n, 3, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    r = causal_rollout(model, torch.Generator().manual_seed(7), torch.Generator().manual_seed(8), cond, SIGMAS,
                       shape=SHAPE, dtype=torch.float64)
    video = replay(model, r)
    assert float((video.detach() - r.x0hat).abs().max()) <= 1e-10 * float(r.x0hat.abs().max())
    g = torch.Generator().manual_seed(7)
    eps = [torch.randn((n, *SHAPE), generator=g, dtype=torch.float64) for _ in range(3)]
    weight = torch.randn(video.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    want, got = grads(model, graph_rollout(model, cond, r.exit_step.cpu(), eps), weight), grads(model, video, weight)
    assert want.keys() == got.keys() and len(got) == len(list(model.parameters()))
    for name, w in want.items():
        assert float((got[name] - w).abs().max()) <= 1e-9 * max(float(w.abs().max()), 1e-12), name


def test_a_chunks_gradient_sees_only_its_own_exit_forward(world):
    """A loss on chunk 0 alone: its weight gradient is the same whatever the later chunks' exit inputs are; a loss
    on the last chunk: the same whatever the earlier chunks' exit inputs are (the cache holds their contexts)."""
    model = causal(SHAPE[1], CausalLayout(2), dtype=torch.float64)
    cond = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    r = causal_rollout(model, torch.Generator().manual_seed(7), torch.Generator().manual_seed(8), cond, SIGMAS,
                       shape=SHAPE, dtype=torch.float64)
    weight = torch.zeros(r.x.shape, dtype=torch.float64)
    weight[:, :, :1] = 1.0  # chunk 0 is frame 0
    before = grads(model, replay(model, r), weight)
    r.x[:, :, 1:] += 3.0  # other exit inputs for chunks 1 and 2
    after = grads(model, replay(model, r), weight)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # and a loss on the last chunk reads the earlier chunks through their (detached) contexts, not their exit steps
    last = torch.zeros(r.x.shape, dtype=torch.float64)
    last[:, :, 3:] = 1.0  # chunk 2 is frames 3-4
    before = grads(model, replay(model, r), last)
    r.x[:, :, :3] -= 2.0
    after = grads(model, replay(model, r), last)
    assert all(torch.equal(before[k], after[k]) for k in before)
    r.context[:, :, :1] += 1.0  # the context of chunk 0 does move it
    assert any(not torch.equal(before[k], v) for k, v in grads(model, replay(model, r), last).items())


def test_grad_chunks_keep_the_gradient_to_the_last_chunks(world):
    """--causal-grad-chunks 2 of 3 chunks: the same video; chunk 0 carries no grad and runs no forward; the gradient
    of a loss on the last two chunks is the full replay's."""
    model = causal(SHAPE[1], CausalLayout(2), dtype=torch.float64)
    cond = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    r = causal_rollout(model, torch.Generator().manual_seed(7), torch.Generator().manual_seed(8), cond, SIGMAS,
                       shape=SHAPE, dtype=torch.float64)
    part, full = replay(model, r, grad_chunks=2), replay(model, r)
    assert torch.equal(part[:, :, :1].detach(), r.x0hat[:, :, :1])
    assert float((part.detach() - full.detach()).abs().max()) <= 1e-10 * float(full.detach().abs().max())
    first = torch.zeros(r.x.shape, dtype=torch.float64)
    first[:, :, :1] = 1.0  # a loss on chunk 0 alone reaches no weight
    assert all(float(g.abs().max()) == 0 for g in grads(model, replay(model, r, grad_chunks=2), first).values())
    weight = torch.zeros(r.x.shape, dtype=torch.float64)
    weight[:, :, 1:] = torch.randn(weight[:, :, 1:].shape, generator=torch.Generator().manual_seed(1),
                                   dtype=torch.float64)
    a, b = grads(model, replay(model, r, grad_chunks=2), weight), grads(model, replay(model, r), weight)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-9, atol=1e-14) for k in a)


def saved_bytes(fn) -> tuple:
    """(fn(), bytes of the tensors autograd saved for backward while fn ran, and those selective recompute's
    checkpoints cached: `benchmarks/plan_vs_measured.kept_bytes`)."""
    from torch.utils._pytree import tree_leaves
    from dmd2_mega.models import recompute
    held, caches, real = [], [], recompute.selective_contexts

    def contexts():
        caching, cached = real()
        caches.append(caching.storage)
        return caching, cached
    recompute.selective_contexts = contexts
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            out = fn()
    finally:
        recompute.selective_contexts = real
    held += [e.val.numel() * e.val.element_size() for e in tree_leaves(caches) if torch.is_tensor(getattr(e, "val", 0))]
    return out, sum(held)


@pytest.mark.parametrize("how", ["full", "selective"])
def test_replay_under_recompute_gives_the_same_gradient(world, how):
    """--recompute-granularity full / selective: the parallel pass recomputes its blocks in backward; the streamed
    replay checkpoints each chunk's exit forward at that granularity (against a read-only view of the cache) and runs
    it again in backward, so it saves a fraction of the activations; either way the gradient is the one without
    recompute."""
    from dataclasses import replace as dc_replace
    model = causal(SHAPE[1], CausalLayout(2), dtype=torch.float64)
    again = WanFamily().build(SPEC, DataShape(4, SHAPE[1:], cond_shape=(3, 16)),
                              options=dc_replace(model.options, recompute=how)).double()
    again.load_state_dict(model.state_dict())
    model.train(), again.train()
    cond = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    r = causal_rollout(model, torch.Generator().manual_seed(7), torch.Generator().manual_seed(8), cond, SIGMAS,
                       shape=SHAPE, dtype=torch.float64)
    weight = torch.randn(r.x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (plain, kept), (rerun, light) = saved_bytes(lambda: replay(model, r)), saved_bytes(lambda: replay(again, r))
    assert torch.equal(plain.detach(), rerun.detach())
    # the chunks' inputs and outputs (selective: and their attention outputs), not every block's activations
    assert light < kept / {"full": 5, "selective": 10}[how], (light, kept)
    a, b = grads(model, plain, weight), grads(again, rerun, weight)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-10, atol=1e-14) for k in a)
    x = torch.randn(2, *SHAPE, dtype=torch.float64)
    sigma = torch.rand(2, 3, dtype=torch.float64).float()
    a, b = grads(model, model(x, sigma, cond), weight), grads(again, again(x, sigma, cond), weight)
    assert all(torch.allclose(a[k], b[k], rtol=1e-10, atol=1e-14) for k in a)


# ---- rollouts past the training length: windows ----------------------------------------------------------------

def test_windows_start_and_end_on_chunk_boundaries_and_are_drawn_uniformly():
    spans = CausalLayout(2).chunks(16)  # 8 chunks of 2
    assert window_starts(spans, 8) == [0, 1, 2, 3, 4] and window_starts(spans, 16) == [0]
    g = torch.Generator().manual_seed(0)
    drawn = [draw_window(spans, 8, g) for _ in range(500)]
    assert {d[1] - d[0] for d in drawn} == {4}
    counts = torch.bincount(torch.tensor([d[0] for d in drawn]), minlength=5)
    assert counts.min() > 60, counts  # uniform over 5 starts: 100 each
    g = torch.Generator().manual_seed(0)
    assert draw_window(spans, 16, g) == (0, 8) and torch.equal(g.get_state(), torch.Generator().manual_seed(0)
                                                               .get_state())  # no draw for the whole rollout
    first_short = CausalLayout(2).chunks(5)  # [1, 2, 2]
    assert window_starts(first_short, 2) == [1, 2] and window_starts(first_short, 3) == [0]
    with pytest.raises(RolloutError, match="no window of 4 frames starts and ends on the chunk boundaries"):
        window_starts(CausalLayout(3).chunks(6), 4)


def test_a_windows_replay_is_the_full_replays_window_and_its_gradient(world):
    """replay(window=(1, 2)) of chunks [1, 2, 2]: chunk 1 (frames 1-2) only, after chunk 0's cache write, equal to
    the full replay's chunk 1 in value and in the gradient of a loss on it; the window with grad on its last chunk
    only (--causal-grad-chunks 1) is that chunk's, chunk 1 then as the rollout made it."""
    model = causal(SHAPE[1], CausalLayout(2), dtype=torch.float64)
    cond = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    r = causal_rollout(model, torch.Generator().manual_seed(7), torch.Generator().manual_seed(8), cond, SIGMAS,
                       shape=SHAPE, dtype=torch.float64)
    spans = model.causal_layout.chunks(SHAPE[1])
    part, full = replay(model, r, window=(1, 2)), replay(model, r)
    seen = r.window((1, 2), spans)
    assert part.shape == seen.x0hat.shape == (2, 4, 2, 4, 6) and seen.sigma.shape == (2, 1)
    assert float((part.detach() - full[:, :, 1:3].detach()).abs().max()) <= 1e-10
    weight = torch.randn(full.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    masked = torch.zeros_like(weight)
    masked[:, :, 1:3] = weight[:, :, 1:3]
    a, b = grads(model, part, weight[:, :, 1:3]), grads(model, full, masked)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-9, atol=1e-14) for k in a)
    tail = replay(model, r, grad_chunks=1, window=(1, 3))
    assert torch.equal(tail[:, :, :2].detach(), r.x0hat[:, :, 1:3])
    last = torch.zeros_like(weight)
    last[:, :, 3:] = weight[:, :, 3:]
    a, b = grads(model, tail, weight[:, :, 1:]), grads(model, replay(model, r), last)
    assert all(torch.allclose(a[k], b[k], rtol=1e-9, atol=1e-14) for k in a)
