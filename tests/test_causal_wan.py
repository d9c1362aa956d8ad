"""The causal Wan student (issue 29, items 1-3): chunks, block-causal attention, per-chunk noise, the KV-cached
streaming path and the rolling window (dmd2_mega/models/causal.py, dmd2_mega/models/wan/causal.py).

  a. The layout's arithmetic: chunks (the first one shorter), which chunks a chunk sees, key ranges, bad flags.
  b. The parallel block-causal pass equals the chunk-by-chunk cached pass (chunk 1 and 3, frame counts that are
     not a multiple, with and without a window + sink; fp32 within 1e-5), past the training length too, with the
     cache's bytes bounded by the window.
  c. One chunk covering all frames is the bidirectional Wan exactly; per-chunk levels all equal are the [B] path.
  d. An independent reference in float64: diffusers' WanTransformer3DModel, its per-token timestep path (Wan 2.2
     TI2V's) fed each token's chunk level and its self-attention given the block mask this test writes from the
     rule, against our causal model in float64, with and without the window.
TP / CP: tests/test_causal_wan_parallel.py.
"""
import warnings

import pytest
import torch
from diffusers import WanTransformer3DModel

from dmd2_mega.errors import ConfigError
from dmd2_mega.models import BuildOptions, DataShape, build_model
from dmd2_mega.models.causal import CausalLayout
from dmd2_mega.models.wan import WanSpec
from dmd2_mega.models.wan.diffusers import diffusers_name
from dmd2_mega.models.wan.family import WanFamily
from tests.utils import world_of_one

pytestmark = pytest.mark.timeout(300)

SPEC = WanSpec("causal-test", num_heads=2, head_dim=12, num_layers=2, ffn_dim=32, in_channels=4, out_channels=4,
               text_dim=16, freq_dim=16, patch_size=(1, 2, 2), rope_max_seq_len=64)
WAN = WanFamily()


@pytest.fixture(scope="module")
def world():
    with world_of_one() as ps:
        yield ps


def causal(frames: int, layout: CausalLayout, seed: int = 0, dtype=torch.float32):
    """A causal model of SPEC for clips of `frames` frames [4, frames, 4, 6], every weight random."""
    torch.manual_seed(seed)
    m = WAN.build(SPEC, DataShape(4, (frames, 4, 6), cond_shape=(3, 16)), options=BuildOptions(causal=layout))
    with torch.no_grad():
        for p in m.parameters():  # nothing zero-initialised stays zero
            p.add_(0.1 * torch.randn_like(p))
    return m.to(dtype).eval()


def inputs(frames: int, chunks: int, b: int = 2, seed: int = 1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, 4, frames, 4, 6, generator=g).to(dtype), torch.rand(b, chunks, generator=g).to(dtype),
            torch.randn(b, 3, 16, generator=g).to(dtype))


def rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max()) / float(b.double().abs().max())


# ---- a. the layout ------------------------------------------------------------------------------------------

def test_chunks_put_the_short_one_first():
    assert CausalLayout(3).chunks(7) == [(0, 1), (1, 4), (4, 7)]
    assert CausalLayout(3).chunks(6) == [(0, 3), (3, 6)]
    assert CausalLayout(1).chunks(3) == [(0, 1), (1, 2), (2, 3)]
    assert CausalLayout(5).chunks(2) == [(0, 2)]


def test_visible_chunks_window_and_sink():
    assert CausalLayout(1).visible(3) == [0, 1, 2, 3]
    assert CausalLayout(1, window=2).visible(3) == [2, 3]
    assert CausalLayout(1, window=2, sink=1).visible(3) == [0, 2, 3]
    assert CausalLayout(1, window=1, sink=2).visible(1) == [0, 1]
    assert CausalLayout(1, window=2, sink=1).kept(4) == [0, 3]  # what the cache holds for chunk 4
    # ranges in tokens (3 per frame), adjacent chunks merged
    assert CausalLayout(2).key_ranges(2, 6, 3) == [(0, 18)]
    assert CausalLayout(1, window=2, sink=1).key_ranges(4, 5, 3) == [(0, 3), (9, 15)]


@pytest.mark.parametrize("kw, flag", [(dict(chunk_frames=0), "--causal-chunk-frames"),
                                      (dict(window=0), "--causal-local-attn-chunks"),
                                      (dict(sink=-1), "--causal-sink-chunks"),
                                      (dict(sink=1), "--causal-local-attn-chunks W too")])
def test_bad_layouts_name_the_flag(kw, flag):
    with pytest.raises(ConfigError, match=flag):
        CausalLayout(**kw)


def test_a_dit_or_two_experts_cannot_be_causal(world):
    with pytest.raises(ConfigError, match="DiT, an image model"):
        build_model("debug", DataShape(4, 8, num_classes=10), options=BuildOptions(causal=CausalLayout()))
    from dataclasses import replace
    with pytest.raises(ConfigError, match="two experts"):
        WAN.build(replace(SPEC, boundary_ratio=0.9), DataShape(4, (3, 4, 6), cond_shape=(3, 16)),
                  options=BuildOptions(causal=CausalLayout()))


def test_sigma_of_the_wrong_shape_is_refused(world):
    m = causal(7, CausalLayout(3))
    x, sigma, cond = inputs(7, 3)
    with pytest.raises(ValueError, match=r"sigma \[B\] or \[B, chunks\] = \[B, 3\]"):
        m(x, sigma[:, :2], cond)
    with pytest.raises(ValueError, match="one noise level per sample"):
        m.stream_forward(x[:, :, :1], sigma, cond, m.new_cache())


# ---- b. parallel == streamed ------------------------------------------------------------------------------

def stream(m, x, sigma, cond, layout):
    """Chunk by chunk through one cache, each chunk written after its forward; the outputs joined."""
    cache = m.new_cache()
    out = [m.stream_forward(x[:, :, a:b], sigma[:, i], cond, cache, write=True)
           for i, (a, b) in enumerate(layout.chunks(x.shape[2]))]
    return torch.cat(out, dim=2), cache


LAYOUTS = {"chunk3": CausalLayout(3), "chunk1": CausalLayout(1), "chunk2-window2-sink1": CausalLayout(2, 2, 1),
           "chunk1-window3": CausalLayout(1, 3)}


@pytest.mark.parametrize("frames", [7, 6])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parallel_pass_equals_the_cached_stream(world, name, frames):
    layout = LAYOUTS[name]
    m = causal(frames, layout)
    x, sigma, cond = inputs(frames, len(layout.chunks(frames)))
    with torch.no_grad():
        want, (got, _) = m(x, sigma, cond), stream(m, x, sigma, cond, layout)
    assert rel(got, want) <= 1e-5
    # and block-causal: a later chunk's input does not move an earlier chunk's output
    first = layout.chunks(frames)[0][1]
    x2 = x.clone()
    x2[:, :, first:] += 1.0
    with torch.no_grad():
        assert torch.equal(m(x2, sigma, cond)[:, :, :first], want[:, :, :first])
        assert not torch.equal(m(x2, sigma, cond)[:, :, first:], want[:, :, first:])


def test_streaming_past_the_training_length_keeps_the_cache_bounded(world):
    """A model built for 4 frames streams 12 (rotary positions absolute: frames 8-11 rotate as in a 12-frame clip)
    and equals the parallel pass over all 12; with a window the cache stops growing."""
    layout = CausalLayout(2, window=2, sink=1)
    m = causal(4, layout)
    x, sigma, cond = inputs(12, 6)
    with torch.no_grad():
        want = m(x, sigma, cond)
        cache, sizes, out = m.new_cache(), [], []
        for i, (a, b) in enumerate(layout.chunks(12)):
            out.append(m.stream_forward(x[:, :, a:b], sigma[:, i], cond, cache, write=True))
            sizes.append(cache.nbytes())
    assert rel(torch.cat(out, 2), want) <= 1e-5
    assert cache.frames == 12 and cache.chunks == 6
    assert all(len(layer) == 2 for layer in cache.self_kv)  # the sink chunk and the last one
    assert sizes[1:] == [sizes[1]] * 5 and sizes[0] < sizes[1]


def test_a_step_that_does_not_write_leaves_the_cache_alone(world):
    """The few-step sampler runs a chunk at several levels against the same cache, then writes it once."""
    layout = CausalLayout(2)
    m = causal(4, layout)
    x, sigma, cond = inputs(4, 2)
    with torch.no_grad():
        cache = m.new_cache()
        m.stream_forward(x[:, :, :2], sigma[:, 0], cond, cache, write=True)
        before = cache.nbytes()
        a = m.stream_forward(x[:, :, 2:], sigma[:, 1], cond, cache)
        m.stream_forward(torch.randn_like(x[:, :, 2:]), sigma[:, 0], cond, cache)
        b = m.stream_forward(x[:, :, 2:], sigma[:, 1], cond, cache)
    assert cache.nbytes() == before and cache.chunks == 1 and cache.frames == 2
    assert torch.equal(a, b)


def test_an_image_to_video_student_streams_from_its_image(world):
    """The concat I2V form (in_channels 2 x 4 + 4): each streamed chunk reads its frames of [mask, image latent]
    (the mask on the clip's first frame only; past the condition's 4 frames the last one repeats), and equals the
    parallel pass over 8 frames from a model built for 4; the image matters; the first-frame form is refused."""
    from dataclasses import replace
    layout, spec = CausalLayout(2, window=2, sink=1), replace(SPEC, in_channels=12)
    parts = (("text", (3, 16)), ("image", (4, 4, 4, 6)))
    torch.manual_seed(0)
    m = WAN.build(spec, DataShape(4, (4, 4, 6), cond_parts=parts), options=BuildOptions(causal=layout))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    m.eval()
    x, sigma, text = inputs(8, 4)
    image = torch.cat([torch.randn(2, 4, 1, 4, 6), torch.zeros(2, 4, 3, 4, 6)], dim=2)
    cond = torch.cat([text.flatten(1), image.flatten(1)], dim=1)
    with torch.no_grad():
        want, (got, _) = m(x, sigma, cond), stream(m, x, sigma, cond, layout)
        other = m(x, sigma, torch.cat([text.flatten(1), torch.zeros_like(image).flatten(1)], dim=1))
    assert rel(got, want) <= 1e-5
    assert rel(other[:, :, :2], want[:, :, :2]) > 1e-3
    with pytest.raises(ConfigError, match="concat form only"):
        WAN.build(SPEC, DataShape(4, (4, 4, 6), cond_parts=(("text", (3, 16)), ("image", (4, 1, 4, 6)))),
                  options=BuildOptions(causal=layout))


# ---- c. the degenerate cases ------------------------------------------------------------------------------

def test_one_chunk_is_the_bidirectional_wan_exactly(world):
    m = causal(5, CausalLayout(5))
    bi = WAN.build(SPEC, DataShape(4, (5, 4, 6), cond_shape=(3, 16))).eval()
    bi.load_state_dict(m.state_dict())
    x, sigma, cond = inputs(5, 1)
    with torch.no_grad():
        assert torch.equal(m(x, sigma, cond), bi(x, sigma[:, 0], cond))
        assert torch.equal(m(x, sigma[:, 0], cond), bi(x, sigma[:, 0], cond))
        assert torch.equal(m.features(x, sigma, cond, 1), bi.features(x, sigma[:, 0], cond, 1))


def test_equal_levels_per_chunk_are_the_b_sigma_path_exactly(world):
    m = causal(7, CausalLayout(3))
    x, sigma, cond = inputs(7, 3)
    with torch.no_grad():
        assert torch.equal(m(x, sigma[:, :1].expand(2, 3), cond), m(x, sigma[:, 0], cond))


# ---- d. diffusers in float64, with the block mask written here ----------------------------------------------

def block_mask(frames: int, per_frame: int, layout: CausalLayout) -> torch.Tensor:
    """[S, S] bool, True where query token q may see key token k: the rule of issue 29, written out per token."""
    first = frames % layout.chunk_frames or layout.chunk_frames
    chunk = [0 if f < first else 1 + (f - first) // layout.chunk_frames for f in range(frames)]
    c = torch.tensor([chunk[t // per_frame] for t in range(frames * per_frame)])
    cq, ck = c[:, None], c[None, :]
    near = (ck > cq - layout.window) if layout.window is not None else torch.ones_like(cq == ck)
    return (ck <= cq) & ((ck < layout.sink) | near)


class Masked:
    """diffusers' attention processor with `mask` passed to its self-attention."""

    def __init__(self, inner, mask):
        self.inner, self.mask = inner, mask

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        return self.inner(attn, hidden_states, encoder_hidden_states, self.mask, rotary_emb)


@pytest.mark.parametrize("layout", [CausalLayout(5), CausalLayout(2), CausalLayout(1, window=2, sink=1)],
                         ids=["one-chunk", "chunk2", "window"])
def test_float64_against_diffusers_with_a_block_mask_and_per_token_timesteps(world, layout):
    """Our float64 path keeps rotary tables in float32 (as diffusers' fp32 models do), so it meets diffusers' to
    ~1e-7, the bidirectional one-chunk case included; a wrong mask or a wrong level per token is O(1)."""
    frames, per_frame = 5, 2 * 3  # latent 4 x 6 at patch 2 x 2
    m = causal(frames, layout, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = WanTransformer3DModel(**{k: v for k, v in SPEC.diffusers_config().items() if k != "_class_name"})
    theirs = dict(ref.named_parameters())
    ref.load_state_dict({diffusers_name(n): p.detach().reshape(theirs[diffusers_name(n)].shape)
                         for n, p in m.named_parameters()})
    ref = ref.double().eval()
    spans = layout.chunks(frames)
    x, sigma, cond = inputs(frames, len(spans), dtype=torch.float64)
    per_token = torch.cat([sigma[:, i:i + 1].expand(-1, (b - a) * per_frame) for i, (a, b) in enumerate(spans)], 1)
    with torch.no_grad():
        got, unmasked = m(x, sigma, cond), ref(x, per_token * 1000, cond).sample
        for blk in ref.blocks:
            blk.attn1.processor = Masked(blk.attn1.processor, block_mask(frames, per_frame, layout))
        want = ref(x, per_token * 1000, cond).sample
        one_level = ref(x, sigma[:, -1] * 1000, cond).sample
    assert rel(got, want) <= 1e-6
    if len(spans) > 1:  # the mask and the levels matter at this size
        assert rel(unmasked, want) > 1e-3 and rel(one_level, want) > 1e-3
