"""Shared test settings of the kernel tests (imported by tests/test_kernels_*.py) and dispatch tests.

The Triton path runs interpreted on CPU tensors (TRITON_INTERPRET=1, which tests/conftest.py sets
where CUDA is absent, before anything imports triton) or compiled on CUDA tensors on a GPU.
"""
import collections

import pytest
import torch
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import dmd2_kernels
from dmd2_kernels import _utils

if _utils.INTERPRET:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:  # fail loudly rather than silently skipping every Triton-path test
    raise RuntimeError("kernel tests need TRITON_INTERPRET=1 in the environment before triton is imported "
                       "(tests/conftest.py sets it without CUDA) or a CUDA device; got neither")

IMPLS = ["triton", "torch"]
# dtype -> (atol, rtol) for tensors stored in that dtype (outputs and gradients).
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2), torch.float16: (2e-3, 2e-3)}
# float32 results reduced from inputs of any dtype (losses, normalisers): float32 accumulation only.
LOSS_TOL = (1e-6, 2e-5)
DTYPES = list(TOL)
BATCHES = [1, 3, 8]
SHAPES = [(3, 7, 5), (4, 33, 17)]  # per-sample shapes: odd sizes, non-power-of-two tails
LARGE = (16, 128, 128)  # 2^18 elements per sample; run for float32 only
assert torch.Size(LARGE).numel() >= 2 ** 18


def dtype_id(dtype):
    return str(dtype).replace("torch.", "")


def case_id(B, shape, dtype, impl):
    return f"B{B}-{'x'.join(map(str, shape))}-{dtype_id(dtype)}-{impl}"


def cases(large=True):
    """(B, shape, dtype, impl) for the matrix above, plus the large float32 case on both paths."""
    out = [pytest.param(B, s, d, i, id=case_id(B, s, d, i))
           for i in IMPLS for d in DTYPES for B in BATCHES for s in SHAPES]
    if large:
        out += [pytest.param(1, LARGE, torch.float32, i, id=case_id(1, LARGE, torch.float32, i)) for i in IMPLS]
    return out


def randn(B, shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn((B,) + tuple(shape), generator=g)).to(device=DEVICE, dtype=dtype)


def rand_sigma(B, seed):
    g = torch.Generator().manual_seed(seed)
    return (0.02 + 0.96 * torch.rand(B, generator=g)).to(DEVICE)


def assert_close(actual, expected, dtype, tol=None, msg=""):
    """Compare in float64 with the tolerance of ``dtype`` (or an explicit (atol, rtol))."""
    atol, rtol = tol or TOL[dtype]
    torch.testing.assert_close(actual.detach().double().cpu(), expected.detach().double().cpu(),
                               atol=atol, rtol=rtol, equal_nan=True, msg=lambda m: f"{msg}\n{m}")


def grad_tol(dtype, ref):
    """(atol, rtol) for a gradient whose entries are tiny (a mean over the sample or batch): atol
    relative to the gradient's scale, plus the spacing of float16 subnormals (2^-24)."""
    atol, rtol = TOL[dtype]
    scale = ref.detach().abs().nan_to_num(posinf=0.0).max().item()
    return atol * scale + (2.0 ** -24 if dtype == torch.float16 else 0.0), rtol


def f64(*ts):
    return [t.detach().double().requires_grad_(t.requires_grad) for t in ts]


# ----------------------------------------------------------------------------------- dispatch


def test_auto_dispatch_cpu_is_torch(monkeypatch):
    monkeypatch.setattr(_utils, "DEFAULT_IMPL", None)
    assert _utils.resolve_impl(None, torch.zeros(2, 3)) == "torch"
    # float64 never takes the Triton path by itself
    assert _utils.resolve_impl(None, torch.zeros(2, 3, dtype=torch.float64)) == "torch"


def test_default_impl_forces_path(monkeypatch):
    """DMD2_KERNELS is read once, at import (`_utils.DEFAULT_IMPL`); set_default_impl changes it, validated."""
    x = torch.zeros(2, 3, device=DEVICE)
    monkeypatch.setattr(_utils, "DEFAULT_IMPL", None)  # restored after the test
    assert dmd2_kernels.set_default_impl("torch") is None
    assert _utils.resolve_impl(None, x) == "torch"
    assert dmd2_kernels.set_default_impl("triton") == "torch"  # returns the previous value
    assert _utils.resolve_impl(None, x) == "triton"
    assert _utils.resolve_impl("torch", x) == "torch"  # the explicit argument wins
    assert dmd2_kernels.set_default_impl("auto") == "triton" and _utils.DEFAULT_IMPL is None
    with pytest.raises(dmd2_kernels.KernelError,
                       match="DMD2_KERNELS='cuda': expected one of 'triton', 'torch' or 'auto'"):
        dmd2_kernels.set_default_impl("cuda")
    assert _utils.DEFAULT_IMPL is None  # a bad value changes nothing


def test_env_is_parsed_at_import_not_per_call(monkeypatch):
    """The import-time parse: "" / "auto" -> None, case and spaces ignored, a bad value one clear error; setting the
    variable later changes no call."""
    assert _utils.parse_default_impl(None) is None and _utils.parse_default_impl(" Auto ") is None
    assert _utils.parse_default_impl(" TRITON") == "triton" and _utils.parse_default_impl("torch") == "torch"
    with pytest.raises(dmd2_kernels.KernelError, match="DMD2_KERNELS"):
        _utils.parse_default_impl("cuda")
    monkeypatch.setattr(_utils, "DEFAULT_IMPL", None)
    monkeypatch.setenv("DMD2_KERNELS", "cuda")  # read at import only: no effect, no error
    assert _utils.resolve_impl(None, torch.zeros(2, 3)) == "torch"


def test_default_triton_runs_kernel(monkeypatch):
    """DEFAULT_IMPL "triton" routes a public op through the Triton path (its custom op)."""
    calls = []
    from dmd2_kernels import x0_projection
    real = x0_projection._fwd_triton
    monkeypatch.setattr(x0_projection, "_fwd_triton", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(_utils, "DEFAULT_IMPL", "triton")
    x = torch.randn(2, 3, device=DEVICE)
    dmd2_kernels.x0_from_velocity(x, x, 0.5)
    monkeypatch.setattr(_utils, "DEFAULT_IMPL", "torch")
    dmd2_kernels.x0_from_velocity(x, x, 0.5)
    assert calls == [1]


def test_bad_arguments():
    x = torch.randn(2, 3, 4, device=DEVICE)
    with pytest.raises(dmd2_kernels.KernelError, match="impl"):
        dmd2_kernels.x0_from_velocity(x, x, 0.5, impl="cuda")
    with pytest.raises(dmd2_kernels.KernelError, match="float64"):
        dmd2_kernels.x0_from_velocity(x.double(), x.double(), 0.5, impl="triton")
    with pytest.raises(dmd2_kernels.KernelError, match="v has shape"):
        dmd2_kernels.x0_from_velocity(x, x[:, :2], 0.5)
    with pytest.raises(dmd2_kernels.KernelError, match="v has dtype"):
        dmd2_kernels.x0_from_velocity(x, x.half(), 0.5)
    with pytest.raises(dmd2_kernels.KernelError, match="sigma must be a number or a \\[B\\] tensor with B=2"):
        dmd2_kernels.x0_from_velocity(x, x, torch.rand(3, device=DEVICE))
    with pytest.raises(dmd2_kernels.KernelError, match="sigma must not require grad"):
        dmd2_kernels.x0_from_velocity(x, x, torch.rand(2, device=DEVICE, requires_grad=True))
    with pytest.raises(dmd2_kernels.KernelError, match="space"):
        dmd2_kernels.flow_matching_loss(x, x, x, 0.5, space="eps")
    with pytest.raises(dmd2_kernels.KernelError, match="scale must be"):
        dmd2_kernels.adaln_modulate(x, torch.zeros(2, 4, device=DEVICE), torch.zeros(2, 3, device=DEVICE))


@pytest.mark.parametrize("impl", IMPLS)
def test_per_sample_scalar_layouts(impl):
    """A float, a one-element tensor, [B] and [B, 1, 1, 1] sigma give the same result."""
    x, v = randn(3, (2, 5, 5), torch.float32, 0), randn(3, (2, 5, 5), torch.float32, 1)
    want = x - 0.25 * v
    for sigma in (0.25, torch.tensor(0.25), torch.full((3,), 0.25), torch.full((3, 1, 1, 1), 0.25)):
        assert_close(dmd2_kernels.x0_from_velocity(x, v, sigma, impl=impl), want, torch.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_non_contiguous_input(impl):
    x = randn(3, (5, 7), torch.float32, 0).transpose(1, 2)
    v = randn(3, (5, 7), torch.float32, 1).transpose(1, 2)
    s = rand_sigma(3, 2)
    assert_close(dmd2_kernels.x0_from_velocity(x, v, s, impl=impl), x - s[:, None, None] * v, torch.float32)


# ------------------------------------------------------------- per-sample scalars


def test_per_sample_makes_no_tensor_from_a_number_and_no_copy_of_a_tensor():
    """A Python number stays a float (no torch.full per call); a float32 tensor on the device is viewed, not copied:
    [B] as it is, one element expanded (stride 0), [B, 1, 1] and a strided [B] viewed as [B]."""
    assert _utils.per_sample(3, 4, torch.device(DEVICE), "g") == 3.0
    assert isinstance(_utils.per_sample(0.25, 4, torch.device(DEVICE), "g"), float)
    base = torch.rand(4, 2, device=DEVICE)
    for t, stride in ((base[:, 0].contiguous(), 1), (base[:1, 0], 0), (base[:, :1, None], 2), (base[:, 0], 2)):
        s = _utils.per_sample(t, 4, torch.device(DEVICE), "g")
        assert s.shape == (4,) and s.stride(0) == stride and s.data_ptr() == t.data_ptr()
    with pytest.raises(dmd2_kernels.KernelError, match="g must be a number or a \\[B\\] tensor, got bool"):
        _utils.per_sample(True, 4, torch.device(DEVICE), "g")


# ------------------------------------------------------------- launch counts (property tests, not timings)

NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view"}


class Launches(TorchDispatchMode):
    """What a block of code launches: the aten ops that reach the dispatcher, less views and bare allocations (as
    benchmarks/count_launches.py counts them), in ``ops``, and the Triton kernels, by name, in ``kernels``. A dmd2
    custom op is not counted itself: its implementation runs under the mode, so the ops and kernels inside it are.
    Under the interpreter a launch is counted at `_utils._Interpreted` (the host copies the interpreter makes are
    not launches and are not counted); on CUDA through triton's launch hook."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.ops, self.kernels, self.depth = collections.Counter(), collections.Counter(), 0
        if _utils.INTERPRET:
            real = _utils._Interpreted.__call__

            def launch(wrapper, *args, **kwargs):
                if not self.depth:
                    return real(wrapper, *args, **kwargs)
                self.kernels[wrapper.kernel.fn.__name__] += 1
                with _disable_current_modes():
                    return real(wrapper, *args, **kwargs)
            monkeypatch.setattr(_utils._Interpreted, "__call__", launch)
        else:  # compiled kernels report their launches to triton's hook (its metadata: the kernel's name)
            import triton
            chain = triton.knobs.runtime.launch_enter_hook
            hook = lambda meta: self.depth and self.kernels.update([meta.get()["name"]])  # noqa: E731
            monkeypatch.setattr(chain, "calls", chain.calls + [hook])  # the hook is gone after the test

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "dmd2":
            with self:
                return OPDEFS[func._schema.name]._init_fn(*args, **kwargs)
        if not func.is_view and func.overloadpacket.__name__ not in NO_LAUNCH:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **kwargs)

    def __enter__(self):  # entered again for each dmd2 op inside: launches count while any entry is open
        self.depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self.depth -= 1
        return super().__exit__(*exc)

    def total(self) -> int:
        return sum(self.ops.values()) + sum(self.kernels.values())


def count_launches(monkeypatch, fn):
    """(Launches of one call of fn, its result)."""
    counter = Launches(monkeypatch)
    with counter:
        out = fn()
    return counter, out


# ---------------------------------------------------------------------------- GPU only


@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA with compiled Triton (TRITON_INTERPRET=0)")
def test_cuda_auto_dispatch_matches_torch_path_at_sdxl_size(monkeypatch):
    """On CUDA the default path is Triton; at an SDXL latent batch in bfloat16 it agrees with the
    torch path on every op (values and gradients)."""
    monkeypatch.setattr(_utils, "DEFAULT_IMPL", None)  # DMD2_KERNELS unset
    shape, dt = (4, 128, 128), torch.bfloat16
    x = randn(8, shape, dt, 0)
    assert _utils.resolve_impl(None, x) == "triton"
    a, b, c = randn(8, shape, dt, 1), randn(8, shape, dt, 2), randn(8, shape, dt, 3)
    sigma = rand_sigma(8, 4)
    with torch.no_grad():
        assert_close(dmd2_kernels.cfg_x0(x, a, b, sigma, 4.5), dmd2_kernels.cfg_x0(x, a, b, sigma, 4.5, impl="torch"),
                     dt)
    outs = {}
    for impl in ("triton", "torch"):
        v = a.clone().requires_grad_()
        fm = dmd2_kernels.flow_matching_loss(v, b, c, sigma, space="x0", impl=impl)
        loss, stats = dmd2_kernels.dmd_loss(v, b, c, impl=impl)
        y = dmd2_kernels.x0_from_velocity(x, v, sigma, impl=impl)
        total = fm.sum() + loss + y.float().square().mean()
        outs[impl] = (fm, loss, stats.norm, stats.grad_rms, *torch.autograd.grad(total, v))
    for got, want in zip(outs["triton"], outs["torch"]):
        assert_close(got, want, dt, tol=(1e-2 * want.abs().max().item() + 1e-6, 1e-2))


# ---------------------------------------------------------------------------- where a fused kernel pays

def test_fused_kernels_run_only_from_the_size_where_they_beat_eager():
    """The H200 table's thresholds (`_utils.FUSED_FROM`): x0 and the flow-matching loss lose to eager below 2^26
    elements (both directions), the other ops win at every size; a gradient through the op picks "fwd+bwd"."""
    small, large = torch.empty(2**21, device="meta"), torch.empty(2**26, device="meta")
    for op in ("x0", "flow_matching"):
        assert not _utils.fused_pays(op, small) and _utils.fused_pays(op, large)
    for op in ("cfg", "dmd", "adaln", "qk_norm_rope", None):
        assert _utils.fused_pays(op, small)
    grad = torch.empty(2**21, device="meta", requires_grad=True)
    try:
        _utils.FUSED_FROM[("cfg", "fwd+bwd")] = 2**22
        assert _utils.fused_pays("cfg", small, grad) is False and _utils.fused_pays("cfg", small, small)
        with torch.no_grad():
            assert _utils.fused_pays("cfg", small, grad)  # no gradient will flow: the forward's threshold
    finally:
        del _utils.FUSED_FROM[("cfg", "fwd+bwd")]


def test_fused_from_override_parses_per_op_and_direction():
    assert _utils.parse_fused_from("x0=1048576, flow_matching:fwd+bwd=0") == {
        ("x0", "fwd"): 1048576, ("x0", "fwd+bwd"): 1048576, ("flow_matching", "fwd+bwd"): 0}
    assert _utils.parse_fused_from("") == {}
    for bad in ("x0", "x0=big", "x0:bwd=3"):
        with pytest.raises(ValueError, match="DMD2_KERNEL_FUSED_FROM"):
            _utils.parse_fused_from(bad)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA with compiled Triton (TRITON_INTERPRET=0)")
def test_cuda_default_dispatch_follows_the_thresholds(monkeypatch):
    """On CUDA without DMD2_KERNELS: x0 at a cycle's size takes the torch path, CFG the Triton one."""
    monkeypatch.setattr(_utils, "DEFAULT_IMPL", None)  # DMD2_KERNELS unset
    x = torch.zeros(8, 4, 128, 128, device="cuda", dtype=torch.bfloat16)
    assert _utils.resolve_impl(None, x, x, op="x0") == "torch"
    assert _utils.resolve_impl(None, x, x, x, op="cfg") == "triton"
