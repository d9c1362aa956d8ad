"""--attention-backend (dmd2_mega/models/attention.py) and the causal student's preallocated KV cache
(dmd2_mega/models/wan/causal.py, `KVCache`), on CPU.

  a. What each backend's kernel is handed, through a fake kernel in its place (SDPA's function, flash-attn 2's and
     FlashAttention-3's `flash_attn_func` as modules of their own) that records its arguments and answers with a
     float64 reference: [B, H, S, d] views for SDPA, [B, S, H, d] for flash, the run's dtype (bf16 for flash),
     stride(-1) == 1, the head dim, no mask or causal flag, at every call site: DiT and Wan self-attention, an I2V
     Wan's text and image cross-attention, the causal Wan's chunk-by-chunk pass and its KV-cached stream (whose keys
     are views of the cache's buffers). The model's output with the fake equals the plain SDPA model's.
  b. Errors: a package that is not installed, no CUDA, fp32 for flash, a GPU or head dim a kernel does not run;
     `sdpa`'s CUDA kernel choice per GPU and dtype, probed once, through a fake probe.
  c. The cache: bit-exact against the concatenating path (a read-only view reads through `torch.cat` as before)
     at every chunk, fp32 and bf16, B = 1 and 3, with and without a window and sink; its buffers allocated once for
     the chunks a query sees and written in place (data_ptr constant); a view unchanged by later writes and
     evictions; a stream longer than sized grows; a chunk written with grad keeps its graph.
  d. On a GPU only (skipped elsewhere): each backend the GPU runs, against the float64 reference.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch

from dmd2_mega.errors import ConfigError
from dmd2_mega.models import BuildOptions, DataShape, attention, build_model, get_spec
from dmd2_mega.models.causal import CausalLayout
from dmd2_mega.models.wan import Wan
from dmd2_mega.models.wan.family import WanFamily
from tests.test_causal_wan import SPEC, inputs, rel
from tests.utils import world_of_one

pytestmark = pytest.mark.timeout(300)
TEXT, CLIP = (5, 16), (7, 8)  # an I2V condition: text tokens x text_dim, CLIP tokens x image_dim
FLASH = ("flash", "flash3")


@pytest.fixture(scope="module")
def world():
    with world_of_one() as ps:
        yield ps


def reference(q, k, v):
    """softmax(q k^T / sqrt(d)) v in float64 on [B, S, H, d], cast back."""
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / q.shape[-1] ** 0.5
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.double()).to(q.dtype)


class Kernel:
    """A backend's kernel stand-in: records (Sq, Skv, heads, head dim, dtype, unit last strides, key storage) of each
    call in [B, S, H, d] terms and answers with `reference`. `heads_first`: SDPA's [B, H, S, d] layout."""

    def __init__(self, heads_first: bool, returns_lse: bool = False):
        self.heads_first, self.returns_lse, self.calls = heads_first, returns_lse, []

    def __call__(self, q, k, v, *args, **kwargs):
        assert not args and not kwargs, (args, kwargs)  # no mask, no causal flag, the default scale
        if self.heads_first:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        self.calls.append({"sq": q.shape[1], "skv": k.shape[1], "heads": q.shape[2], "d": q.shape[3],
                           "dtype": {t.dtype for t in (q, k, v)}, "unit": all(t.stride(-1) == 1 for t in (q, k, v)),
                           "kv_shape": tuple(k.shape), "storage": k.untyped_storage().data_ptr()})
        out = reference(q, k, v)
        out = out.transpose(1, 2) if self.heads_first else out
        return (out, torch.zeros(q.shape[0], q.shape[2], q.shape[1])) if self.returns_lse else out


@pytest.fixture
def kernels(monkeypatch):
    """backend -> its recording kernel, each in its place: SDPA's function, fake flash_attn and flash_attn_interface
    modules (flash3's answering (out, lse) as FlashAttention-3 builds before mid-2025 do)."""
    out = {"sdpa": Kernel(True), "flash": Kernel(False), "flash3": Kernel(False, returns_lse=True)}
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", out["sdpa"])
    for module, backend in (("flash_attn", "flash"), ("flash_attn_interface", "flash3")):
        fake = types.ModuleType(module)
        fake.flash_attn_func = out[backend]
        monkeypatch.setitem(sys.modules, module, fake)
    return out


def built(monkeypatch, make, backend: str):
    """make() under a CUDA machine's checks (a flash backend is built only where CUDA is), from seed 0, every weight
    random (the zero-initialised output layers too)."""
    torch.manual_seed(0)
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        model = make(BuildOptions(attention_backend=backend))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def dit(options):
    return build_model("debug", DataShape(4, 8, num_classes=10), options=options)


def i2v(options):
    parts = (("text", TEXT), ("clip", CLIP), ("image", (4, 3, 4, 6)))
    return Wan(get_spec("wan-i2v-debug"), DataShape(4, (3, 4, 6), cond_parts=parts), options=options)


def causal(frames, layout, options=BuildOptions(), dtype=torch.float32):
    torch.manual_seed(0)
    m = WanFamily().build(SPEC, DataShape(4, (frames, 4, 6), cond_shape=(3, 16)),
                          options=BuildOptions(options.attention_backend, causal=layout))
    with torch.no_grad():
        for p in m.parameters():  # nothing zero-initialised stays zero
            p.add_(0.1 * torch.randn_like(p))
    return m.to(dtype).eval()


def stream(m, x, sigma, cond, layout, cache=None):
    cache = m.new_cache(x.shape[2]) if cache is None else cache
    out = [m.stream_forward(x[:, :, a:b], sigma[:, i], cond, cache, write=True)
           for i, (a, b) in enumerate(layout.chunks(x.shape[2]))]
    return torch.cat(out, 2), cache


# ---- a. what each backend is handed ----------------------------------------------------------------------------

def check_calls(calls, want: list, heads: int, d: int, dtype) -> None:
    """Every call: the expected (Sq, Skv) multiset, heads in the heads place, the head dim, dtype, unit last stride."""
    assert sorted((c["sq"], c["skv"]) for c in calls) == sorted(want)
    for c in calls:
        assert (c["heads"], c["d"], c["dtype"], c["unit"]) == (heads, d, {dtype}, True), c


@pytest.mark.parametrize("backend", ["sdpa", *FLASH])
def test_dit_self_attention(world, monkeypatch, kernels, backend):
    """debug DiT: 2 layers, 4 heads x 8, 8 x 8 latents at patch 2: 16 tokens (q, k, v views of the qkv output)."""
    dtype = torch.bfloat16 if backend in FLASH else torch.float32
    model = built(monkeypatch, dit, backend).to(dtype)
    plain = built(monkeypatch, dit, "sdpa").to(dtype)
    x, sigma, y = torch.randn(3, 4, 8, 8).to(dtype), torch.rand(3), torch.tensor([1, 4, 9])
    with torch.no_grad():
        got = model(x, sigma, y)
    check_calls(kernels[backend].calls, [(16, 16)] * 2, 4, 8, dtype)
    monkeypatch.undo()
    with torch.no_grad():
        want = plain(x, sigma, y)
    assert rel(got, want) <= (2e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("backend", ["sdpa", *FLASH])
def test_wan_self_text_and_image_attention(world, monkeypatch, kernels, backend):
    """wan-i2v-debug: 2 layers, 2 heads x 12; 3 x 4 x 6 latents at patch (1, 2, 2): 18 tokens; per layer the
    self-attention, the text's 5 tokens and the CLIP image's 7."""
    dtype = torch.bfloat16 if backend in FLASH else torch.float32
    model, plain = (built(monkeypatch, i2v, b).to(dtype) for b in (backend, "sdpa"))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 3, 4, 6, generator=g).to(dtype)
    cond = torch.randn(1, TEXT[0] * TEXT[1] + CLIP[0] * CLIP[1] + 4 * 3 * 4 * 6, generator=g).to(dtype)
    with torch.no_grad():
        got = model(x, torch.tensor([0.3]), cond)
    check_calls(kernels[backend].calls, [(18, 18), (18, 5), (18, 7)] * 2, 2, 12, dtype)
    monkeypatch.undo()
    with torch.no_grad():
        want = plain(x, torch.tensor([0.3]), cond)
    assert rel(got, want) <= (2e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("backend", ["sdpa", *FLASH])
def test_causal_chunks_and_the_kv_cache(world, monkeypatch, kernels, backend):
    """The causal Wan (6 tokens a frame, chunks of 1 frame, 3 frames): the parallel pass runs each chunk's queries over
    the keys it sees, (6, 6), (6, 12), (6, 18), and the text's 3 tokens (18, 3); the stream the same blocks per
    chunk, its keys views of the cache's buffers (no copy of the cache)."""
    dtype = torch.bfloat16 if backend in FLASH else torch.float32
    layout = CausalLayout(1)
    model, plain = (built(monkeypatch, lambda o: causal(3, layout, o, dtype), b) for b in (backend, "sdpa"))
    x, sigma, cond = inputs(3, 3, b=3, dtype=dtype)
    kernel = kernels[backend]
    with torch.no_grad():
        model(x, sigma, cond)
        check_calls(kernel.calls, [(6, 6), (6, 12), (6, 18), (18, 3)] * 2, 2, 12, dtype)
        kernel.calls.clear()
        got, cache = stream(model, x, sigma, cond, layout)
    check_calls(kernel.calls, [(6, 6), (6, 3), (6, 12), (6, 3), (6, 18), (6, 3)] * 2, 2, 12, dtype)
    buffers = {kv[0].untyped_storage().data_ptr() for kv in cache.buffers}
    cached = [c for c in kernel.calls if c["skv"] > 6]
    assert len(cached) == 4 and all(c["storage"] in buffers for c in cached)  # read where they were written
    monkeypatch.undo()
    with torch.no_grad():
        want = stream(plain, x, sigma, cond, layout)[0]
    assert rel(got, want) <= (2e-2 if dtype == torch.bfloat16 else 1e-5)


# ---- b. errors and the CUDA kernel choice -----------------------------------------------------------------------

def test_missing_package_and_no_cuda_are_one_config_error(monkeypatch, kernels):
    monkeypatch.delitem(sys.modules, "flash_attn_interface")
    assert not attention._installed("flash_attn_interface_nowhere")
    monkeypatch.setattr(attention, "_installed", lambda module: module != "flash_attn_interface")  # where it is not
    with pytest.raises(ConfigError, match=r"--attention-backend flash3 needs FlashAttention-3 \(flash_attn_interface"):
        built(monkeypatch, dit, "flash3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for backend in ("flash", "cudnn"):  # flash-attn "installed", no CUDA
        with pytest.raises(ConfigError, match=f"--attention-backend {backend} needs CUDA"):
            dit(BuildOptions(attention_backend=backend))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="--attention-backend flash runs on CUDA; this run's device is cpu"):
        attention.choose("flash", "cpu", torch.bfloat16, 8)


def test_flash_refuses_fp32_at_start_up_and_in_a_forward(world, monkeypatch, kernels):
    model = built(monkeypatch, dit, "flash")
    with pytest.raises(ConfigError, match=r"--attention-backend flash takes fp16 / bf16 tensors, got fp32 \(give "
                                          r"--bf16"):
        model(torch.randn(1, 4, 8, 8), torch.rand(1), torch.tensor([1]))
    assert not kernels["flash"].calls
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ConfigError, match="--attention-backend flash3 takes fp16 / bf16; this run computes in fp32"):
        attention.choose("flash3", "cuda:0", torch.float32, 128)


@pytest.mark.parametrize("backend, cap, head_dim, words", [
    ("flash3", (8, 0), 128, r"flash3: FlashAttention-3 runs on Hopper \(sm90\); this GPU is sm80"),
    ("flash3", (10, 0), 128, "this GPU is sm100"),
    ("flash", (7, 5), 64, r"flash: flash-attn 2 runs on sm80 and newer; this GPU is sm75"),
    ("flash", (9, 0), 512, "flash-attn 2 takes head dims up to 256; this model's is 512"),
])
def test_flash_refuses_a_gpu_or_head_dim_it_does_not_run(monkeypatch, kernels, backend, cap, head_dim, words):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    with pytest.raises(ConfigError, match=words):
        attention.choose(backend, "cuda:0", torch.bfloat16, head_dim)


def test_flash_on_a_gpu_it_runs_is_named(monkeypatch, kernels):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert attention.choose("flash3", "cuda:0", torch.bfloat16, 128) == (
        "flash3", "flash3 (FlashAttention-3's flash_attn_func; sm90, bf16, head dim 128)")
    assert attention.choose("flash", "cuda:0", torch.float16, 72)[1].startswith("flash (flash-attn 2's")


class Probe:
    """Stands in for `attention._probe` on a GPU of capability `cap` whose SDPA runs the kernels `runs`."""

    def __init__(self, runs: set):
        self.runs, self.asked = runs, []

    def __call__(self, kernels, device, dtype, head_dim):
        self.asked.append(tuple(kernels))
        first = next((k for k in kernels if k in self.runs), None)
        return (first, "") if first is not None else (None, "cuDNN attention kernel not used because: head dim")


B = attention.SDPBackend
ALL = {B.CUDNN_ATTENTION, B.FLASH_ATTENTION, B.EFFICIENT_ATTENTION, B.MATH}


@pytest.mark.parametrize("cap, dtype, runs, kernels, words", [
    ((9, 0), torch.bfloat16, ALL, (B.CUDNN_ATTENTION, B.FLASH_ATTENTION),
     "sdpa (cuDNN attention, flash attention where it refuses a shape; sm90, bf16, head dim 128)"),
    ((8, 0), torch.float16, ALL, (B.FLASH_ATTENTION, B.CUDNN_ATTENTION),
     "sdpa (flash attention, cuDNN attention where it refuses a shape; sm80, fp16, head dim 128)"),
    ((9, 0), torch.bfloat16, ALL - {B.CUDNN_ATTENTION}, (B.FLASH_ATTENTION, B.CUDNN_ATTENTION),
     "sdpa (flash attention, cuDNN attention where it refuses a shape"),
    ((9, 0), torch.float32, {B.EFFICIENT_ATTENTION, B.MATH}, (B.EFFICIENT_ATTENTION,),
     "sdpa (memory-efficient attention: cuDNN and flash attention take fp16 / bf16 (--bf16); sm90, fp32"),
    ((7, 5), torch.bfloat16, {B.MATH}, (B.MATH,), "sdpa (math: torch's cuDNN and flash kernels refuse it; sm75"),
], ids=["hopper-bf16", "ampere-fp16", "no-cudnn", "fp32", "turing-math-only"])
def test_sdpa_on_cuda_picks_and_names_its_kernels(monkeypatch, cap, dtype, runs, kernels, words):
    probe = Probe(runs)
    monkeypatch.setattr(attention, "_probe", probe)
    monkeypatch.setattr(attention, "_PICKED", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    backend, line = attention.choose("sdpa", "cuda:0", dtype, 128)
    assert backend == "sdpa" and line.startswith(words), line
    asked = len(probe.asked)
    assert attention._cuda_kernels(0, dtype, 128) == kernels  # what a forward runs: the same, not probed again
    assert len(probe.asked) == asked
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # a trace never probes: unprobed is SDPA's own
    assert attention._cuda_kernels(0, dtype, 64) is None and len(probe.asked) == asked


def test_cudnn_alone_or_an_error_with_torchs_reason(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(attention, "_probe", Probe(ALL))
    assert attention.choose("cudnn", "cuda:0", torch.bfloat16, 128)[1] == (
        "cudnn (cuDNN attention alone; sm90, bf16, head dim 128)")
    monkeypatch.setattr(attention, "_probe", Probe(ALL - {B.CUDNN_ATTENTION}))
    with pytest.raises(ConfigError, match=r"--attention-backend cudnn: torch's cuDNN attention cannot run sm90, bf16, "
                                          r"head dim 128: cuDNN attention kernel not used because: head dim"):
        attention.choose("cudnn", "cuda:0", torch.bfloat16, 128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sdpa_on_a_cpu_names_torchs_kernel(dtype):
    assert attention.choose("sdpa", "cpu", dtype, 72) == (
        "sdpa", f"sdpa (its flash-attention CPU kernel, torch's choice on a cpu; {attention._short(dtype)}, head dim "
                f"72)")


# ---- c. the preallocated KV cache ------------------------------------------------------------------------------

LAYOUTS = {"chunk2": CausalLayout(2), "chunk1-window3": CausalLayout(1, 3),
           "chunk2-window2-sink1": CausalLayout(2, 2, 1), "chunk1-window1-sink1": CausalLayout(1, 1, 1)}


@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_in_place_cache_is_bit_exact_to_the_concatenation(world, name, dtype, b):
    """Bit-exact (the same keys in the same order, another batch stride): at every chunk, a forward against the
    cache (keys read in place) and one against a read-only view of it (keys joined by torch.cat, the path every
    forward took before), 7 frames (the first chunk shorter) streamed on a model built for 5."""
    layout = LAYOUTS[name]
    m = causal(5, layout, dtype=dtype)
    x, sigma, cond = inputs(7, len(layout.chunks(7)), b=b, dtype=dtype)
    cache = m.new_cache(7)
    with torch.no_grad():
        for i, (a, e) in enumerate(layout.chunks(7)):
            chunk = x[:, :, a:e]
            joined = m.stream_forward(chunk, sigma[:, i], cond, cache.view())
            assert torch.equal(m.stream_forward(chunk, sigma[:, i], cond, cache), joined), i
            assert torch.equal(m.stream_forward(chunk, sigma[:, i], cond, cache, write=True), joined), i


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cache_is_allocated_once_for_what_a_query_sees_and_written_in_place(world, name):
    """A stream of the size the cache was made for: each layer's buffers keep their storage from the first chunk to
    the last, and hold the most tokens a chunk sees (its kept chunks and itself: 6 tokens a frame)."""
    layout = LAYOUTS[name]
    frames = 9
    m = causal(frames, layout)
    x, sigma, cond = inputs(frames, len(layout.chunks(frames)))
    cache, ptrs = m.new_cache(), []
    with torch.no_grad():
        for i, (a, e) in enumerate(layout.chunks(frames)):
            m.stream_forward(x[:, :, a:e], sigma[:, i], cond, cache)
            m.stream_forward(x[:, :, a:e], sigma[:, i], cond, cache, write=True)
            ptrs.append([kv[0].data_ptr() for kv in cache.buffers] + [kv[1].data_ptr() for kv in cache.buffers])
    assert all(p == ptrs[0] for p in ptrs)
    tokens = layout.visible_frames(frames) * 6
    assert {tuple(t.shape) for kv in cache.buffers for t in kv} == {(2, tokens, 2, 12)}
    want = {"chunk2": 9, "chunk1-window3": 3, "chunk2-window2-sink1": 1 + 2 + 2, "chunk1-window1-sink1": 2}[name]
    assert layout.visible_frames(frames) == want  # chunk2 at 9 frames: 1 + 2 + 2 + 2 + 2; sink + window otherwise
    assert cache.buffer_bytes() == 2 * 2 * (2 * tokens * 2 * 12) * 4  # layers x (k, v) x [B, tokens, H, d] x fp32


@pytest.mark.parametrize("name", ["chunk1-window3", "chunk2-window2-sink1", "chunk1-window1-sink1"])
def test_a_view_reads_the_same_after_later_writes_and_evictions(world, name):
    """A read-only view (a replayed chunk's recompute in backward reads one after the stream moved on) keeps what
    it saw: the moves of an eviction and the next chunks' writes go to new buffers where they would overwrite it."""
    layout = LAYOUTS[name]
    m = causal(8, layout)
    x, sigma, cond = inputs(8, len(layout.chunks(8)))
    chunks = layout.chunks(8)
    cache = m.new_cache()
    with torch.no_grad():
        for i, (a, e) in enumerate(chunks[:2]):
            m.stream_forward(x[:, :, a:e], sigma[:, i], cond, cache, write=True)
        seen = cache.view()
        a, e = chunks[2]
        before = m.stream_forward(x[:, :, a:e], sigma[:, 2], cond, seen.view())
        for i, (a2, e2) in enumerate(chunks[2:], 2):
            m.stream_forward(x[:, :, a2:e2], sigma[:, i], cond, cache, write=True)
        assert torch.equal(m.stream_forward(x[:, :, a:e], sigma[:, 2], cond, seen.view()), before)
    with pytest.raises(ValueError, match="read-only view"):
        m.stream_forward(x[:, :, a:e], sigma[:, 2], cond, seen, write=True)


def test_a_stream_longer_than_sized_grows_and_matches_the_parallel_pass(world):
    """No window, a model built for 3 frames streaming 7: the buffers grow to all 7 frames' tokens."""
    layout = CausalLayout(2)
    m = causal(3, layout)
    x, sigma, cond = inputs(7, 4)
    with torch.no_grad():
        got, cache = stream(m, x, sigma, cond, layout, m.new_cache())
        want = m(x, sigma, cond)
    assert rel(got, want) <= 1e-5
    assert {t.shape[1] for kv in cache.buffers for t in kv} == {7 * 6} and cache.used == 7 * 6


def test_a_chunk_written_with_grad_keeps_its_graph(world):
    """As before the cache was preallocated: a later chunk's loss reaches an earlier chunk written with grad."""
    layout = CausalLayout(1)
    m = causal(2, layout)
    x, sigma, cond = inputs(2, 2)
    first = x[:, :, :1].clone().requires_grad_(True)
    cache = m.new_cache()
    m.stream_forward(first, sigma[:, 0], cond, cache, write=True)
    m.stream_forward(x[:, :, 1:], sigma[:, 1], cond, cache).square().sum().backward()
    assert first.grad is not None and float(first.grad.abs().max()) > 0


# ---- on a GPU: the kernels themselves -----------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs CUDA attention kernels: needs a GPU")
@pytest.mark.parametrize("backend", ["sdpa", "cudnn", *FLASH])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_each_backend_on_a_gpu_matches_the_reference(backend, dtype):
    """Every backend this GPU runs (the others must refuse in `choose`, with a ConfigError), on odd sizes, against
    the float64 reference: bf16 within 2e-2, fp16 within 4e-3 of the largest output (relative)."""
    try:
        attention.choose(backend, "cuda", dtype, 72)
    except ConfigError as e:
        pytest.skip(f"this GPU refuses it: {e}")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(3, 77, 5, 72, generator=g, device="cuda", dtype=dtype)
    kv = torch.randn(3, 130, 2, 5, 72, generator=g, device="cuda", dtype=dtype)[:, :, 0]  # strided, unit last
    out = attention.attention(q, kv, kv, backend)
    assert out.shape == q.shape and out.dtype == dtype
    assert rel(out, reference(q, kv, kv)) <= (2e-2 if dtype == torch.bfloat16 else 4e-3)
