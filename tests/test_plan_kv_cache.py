"""The memory planner's KV cache of a causal student (dmd2_mega/plan/memory_plan.kv_cache_plan, the Wan family's
`kv_cache_bytes` in dmd2_mega/models/wan/plan.py, launch/plan_memory.py --causal).

  a. Against a real cache, bit-exact byte counts: a tiny causal Wan streamed chunk by chunk (`stream_forward(...,
     write=True)`), its `KVCache.nbytes()` read at every chunk just before the eviction (the cache's peak: the chunks
     kept for chunk i and chunk i's own k / v in every layer) equals the planner's per-layer and total bytes, at the
     chunk the planner names, with and without a rolling window + sink, fp32 and bf16, B = 1 and 3.
  b. TP / CP by arithmetic (a world of one cannot run TP = 2): per-rank self-attention bytes x TP x CP and the text's
     x TP are the TP = 1 cache; Wan 2.1 14B's full cache at 81 x 480p checked by hand (40 layers x 32760 tokens x
     20 KiB = 26.8 GB); a chunk the split does not divide counts its padded tokens; a window bounds the cache.
  c. launch/plan_memory.py with the causal flags prints the section with the planner's numbers; bad flags are one
     line.
"""
from __future__ import annotations

import pytest
import torch

from dmd2_mega.errors import ConfigError
from dmd2_mega.models import BuildOptions, DataShape
from dmd2_mega.models.causal import CausalLayout
from dmd2_mega.models.wan import WanSpec
from dmd2_mega.models.wan.family import WanFamily
from dmd2_mega.plan import memory_plan as mp
from launch import plan_memory
from tests.utils import world_of_one

pytestmark = pytest.mark.timeout(300)

SPEC = WanSpec("kv-test", num_heads=4, head_dim=6, num_layers=3, ffn_dim=32, in_channels=4, out_channels=4,
               text_dim=16, freq_dim=16, patch_size=(1, 2, 2), rope_max_seq_len=64)
TEXT_LEN, LATENT = 5, (4, 6)  # 2 x 3 = 6 tokens per frame
LAYOUTS = {"chunk3": CausalLayout(3), "chunk1": CausalLayout(1), "chunk2-window2-sink1": CausalLayout(2, 2, 1),
           "chunk1-window3": CausalLayout(1, 3)}


@pytest.fixture(scope="module")
def world():
    with world_of_one() as ps:
        yield ps


def shape(frames: int, spec=SPEC, latent=LATENT, text_len=TEXT_LEN) -> mp.ModelShape:
    return mp.ModelShape(spec, spec.in_channels, (frames, *latent), num_classes=None,
                         cond_shape=(text_len, spec.text_dim))


def streamed_peaks(layout: CausalLayout, frames: int, b: int, dtype) -> list:
    """[(nbytes, chunks held, layer 0's self-attention bytes, layer 0's text bytes)] of a real cache at each chunk,
    read when the chunk's k / v are written in every layer and before the eviction (`KVCache.advance`)."""
    torch.manual_seed(0)
    m = WanFamily().build(SPEC, DataShape(4, (frames, *LATENT), cond_shape=(TEXT_LEN, 16)),
                          options=BuildOptions(causal=layout)).to(dtype).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, 4, frames, *LATENT, generator=g).to(dtype)
    cond = torch.randn(b, TEXT_LEN, 16, generator=g).to(dtype)
    cache, seen = m.new_cache(), []
    advance = cache.advance

    def record(n):
        layer, text = cache.self_kv[0], cache.text[0]
        seen.append((cache.nbytes(), tuple(sorted(layer)), sum(t.numel() * t.element_size() for kv in layer.values()
                                                             for t in kv),
                     sum(t.numel() * t.element_size() for t in text)))
        advance(n)
    cache.advance = record
    with torch.no_grad():
        for a, e in layout.chunks(frames):
            m.stream_forward(x[:, :, a:e], torch.full((b,), 0.5, dtype=dtype), cond, cache, write=True)
    return seen


# ---- a. the planner against a streamed cache -----------------------------------------------------------------

@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("frames", [7, 6])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planned_bytes_equal_the_streamed_cache(world, name, frames, dtype, b):
    """Bit-exact: byte counts of the same tensors (the planner's formula, the cache's `nbytes()`)."""
    layout = LAYOUTS[name]
    plan = mp.kv_cache_plan(shape(frames), layout, b, tp=1, bf16=dtype == torch.bfloat16)
    seen = streamed_peaks(layout, frames, b, dtype)
    peak = max(s[0] for s in seen)
    assert (plan.frames, plan.chunks, plan.layers) == (frames, len(seen), SPEC.num_layers)
    assert plan.total == peak and plan.group_total == peak
    i = [s[0] for s in seen].index(peak)
    assert plan.peak_chunk == i and plan.held == seen[i][1]
    assert (plan.self_layer, plan.text_layer) == seen[i][2:]
    if layout.window is None:  # nothing is evicted: the peak is the last chunk, every chunk held
        assert i == len(seen) - 1 and plan.held == tuple(range(len(seen)))
    else:
        assert len(plan.held) <= layout.window + layout.sink


def test_a_window_streams_past_the_training_length_at_the_trained_peak(world):
    """--stream-frames past the data's frames: with a window the planned peak (and the real one) stays put."""
    layout = CausalLayout(2, window=2, sink=1)
    short, long = (mp.kv_cache_plan(shape(4), layout, 1, tp=1, bf16=False, frames=f) for f in (8, 16))
    assert short.total == long.total and long.chunks == 8 and long.held == (0, 1, 2)  # sink + the last two
    assert long.total == max(s[0] for s in streamed_peaks(layout, 16, 1, torch.float32))
    unbounded = mp.kv_cache_plan(shape(4), CausalLayout(2), 1, tp=1, bf16=False, frames=16)
    assert 3 * unbounded.self_layer == 8 * short.self_layer  # all 8 chunks of 2 frames against 3


# ---- b. TP / CP by arithmetic ---------------------------------------------------------------------------------

WAN_14B = mp.model_shape("wan2.1-14b", 16, (21, 60, 104), num_classes=None, cond_shape=(512, 4096))


def test_wan_14b_full_cache_by_hand():
    """40 layers, 40 heads x 128 = 5120 wide; bf16 k + v per token per layer 2 x 5120 x 2 B = 20 KiB; 21 frames x
    30 x 52 = 32760 tokens: 40 x 32760 x 20480 B = 26.84 GB at B = 1, TP = 1, plus the text's 40 x 512 x 20 KiB."""
    plan = mp.kv_cache_plan(WAN_14B, CausalLayout(3), 1, tp=1, bf16=True)
    assert (plan.chunks, plan.peak_chunk, len(plan.held)) == (7, 6, 7)
    assert plan.self_layer == 32760 * 20480 and plan.text_layer == 512 * 20480
    assert plan.layers * plan.self_layer == 26_836_992_000
    assert plan.total == 40 * (32760 + 512) * 20480
    fp32_b2 = mp.kv_cache_plan(WAN_14B, CausalLayout(3), 2, tp=1, bf16=False)
    assert fp32_b2.total == 4 * plan.total


@pytest.mark.parametrize("tp,cp,sp", [(2, 1, False), (2, 1, True), (1, 2, False), (2, 2, True), (4, 2, True),
                                      (8, 5, True), (1, 8, False)])
def test_per_rank_bytes_times_tp_and_cp_are_the_tp1_cache(tp, cp, sp):
    """Self-attention k / v: a rank holds a / (TP CP) heads over every token (x TP x CP = TP=1); the text's k / v:
    a / TP heads, not split over CP (x TP = TP=1). A chunk of 3 frames (4680 tokens) is divided by every split here:
    no padding."""
    one = mp.kv_cache_plan(WAN_14B, CausalLayout(3), 1, tp=1, bf16=True)
    got = mp.kv_cache_plan(WAN_14B, CausalLayout(3), 1, tp=tp, bf16=True, cp=cp, sp=sp)
    assert got.self_layer * tp * cp == one.self_layer and got.text_layer * tp == one.text_layer
    assert got.self_layer == 2 * 32760 * (40 // (tp * cp)) * 128 * 2
    assert got.group_total == got.total * tp * cp
    maths = WAN_14B.family.plan.kv_cache
    assert maths(WAN_14B, 1, 3, tp, True, cp, sp) == (2 * 4680 * (40 // (tp * cp)) * 128 * 2,
                                                     2 * 512 * (40 // tp) * 128 * 2)


def test_a_chunk_the_split_does_not_divide_counts_its_padding():
    """6 tokens per frame over CP = 4: a one-frame chunk is padded to 8 tokens (the cache keeps views of the padded
    all-to-all output); under SP at TP = 2 with CP = 2 too."""
    spec = WanSpec("kv-pad", num_heads=8, head_dim=6, num_layers=2, ffn_dim=32, in_channels=4, out_channels=4,
                   text_dim=16, freq_dim=16, patch_size=(1, 2, 2), rope_max_seq_len=64)
    ms, maths = shape(5, spec), WanFamily.plan.kv_cache
    assert maths(ms, 1, 1, 1, False, 4, False)[0] == 2 * 8 * (8 // 4) * 6 * 4
    assert maths(ms, 1, 1, 2, False, 2, True)[0] == 2 * 8 * (8 // 4) * 6 * 4
    assert maths(ms, 1, 2, 1, False, 4, False)[0] == 2 * 12 * (8 // 4) * 6 * 4  # 12 tokens: no padding


def test_no_causal_student_is_one_configerror():
    with pytest.raises(ConfigError, match="DiT, an image model"):
        mp.kv_cache_plan(mp.model_shape("2b", 4, 32, num_classes=1000), CausalLayout(3), 1, tp=1, bf16=True)
    a14b = mp.model_shape("wan2.2-a14b", 16, (21, 60, 104), num_classes=None, cond_shape=(512, 4096))
    with pytest.raises(ConfigError, match="two experts"):
        mp.kv_cache_plan(a14b, CausalLayout(3), 1, tp=1, bf16=True)


# ---- c. the CLI ---------------------------------------------------------------------------------------------------

ROW = ["--model-size", "wan2.1-14b", "--latent-shape", "16", "21", "60", "104", "--text-len", "512", "--bf16",
       "--micro-batch-size", "1", "--tensor-model-parallel-size", "2", "--sequence-parallel"]


def test_cli_prints_the_kv_cache_section(capsys):
    assert plan_memory.main(ROW + ["--causal", "--causal-chunk-frames", "3", "--causal-local-attn-chunks", "3",
                                   "--causal-sink-chunks", "1", "--stream-frames", "120"]) == 0
    out = capsys.readouterr().out
    section = out.split("KV cache of the causal student (causal: chunks of 3 frames, each attending to itself and "
                        "the last 3 chunks and the first 1 (sink)), per rank at TP=2 CP=1 SP, B=1, bf16")[1]
    layout = CausalLayout(3, 3, 1)
    gen = mp.kv_cache_plan(WAN_14B, layout, 1, tp=2, bf16=True, sp=True, frames=120)
    roll = mp.kv_cache_plan(WAN_14B, layout, 1, tp=2, bf16=True, sp=True)
    f = plan_memory.fmt_bytes
    for line, k, start in (("generation, 120 frames", gen, "4 of 40"), ("rollout, 21 frames (data)", roll, "4 of 7")):
        row = next(r for r in section.splitlines() if r.startswith(line))
        cells = [f(v) for v in (k.self_layer, k.text_layer, k.per_layer, k.total, k.group_total, k.forward,
                                k.with_forward)]
        assert row.split(line)[1].split() == [*start.split(), "4", *" ".join(cells).split()], row
    assert gen.self_layer == 2 * (4 * 4680) * 20 * 128 * 2 and gen.text_layer == 2 * 512 * 20 * 128 * 2  # by hand
    assert "generation per rank: student weights " in section and "streamed rollout phase per rank" in section
    assert plan_memory.main(ROW) == 0
    assert "KV cache" not in capsys.readouterr().out  # off without --causal


@pytest.mark.parametrize("flags,error", [
    (["--stream-frames", "30"], "--stream-frames: the length of a causal student's streamed generation; add --causal"),
    (["--causal", "--causal-local-attn-chunks", "2", "--causal-sink-chunks", "-1"],
     "--causal-sink-chunks must be >= 0"),
    (["--causal", "--causal-sink-chunks", "1"], "give --causal-local-attn-chunks W too"),
    (["--causal", "--causal-chunk-frames", "0"], "--causal-chunk-frames must be >= 1"),
    (["--causal", "--stream-frames", "0"], "--stream-frames must be >= 1, got 0"),
])
def test_cli_causal_errors_are_one_line(capsys, flags, error):
    assert plan_memory.main(ROW + flags) == 1
    err = capsys.readouterr().err
    assert err.startswith("ConfigError: ") and err.count("\n") == 1 and error in err, err


def test_cli_dit_with_causal_flags_fails_before_printing(capsys):
    row = ["--model-size", "2b", "--latent-shape", "4", "32", "32", "--causal"]
    assert plan_memory.main(row) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "DiT, an image model" in captured.err
