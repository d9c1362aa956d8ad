"""The kernels inside torch.compile: the ops a transformer block calls (adaln_modulate, qk_norm_rope) and the DMD2
loss ops (x0_from_velocity, cfg_x0, flow_matching_loss, dmd_loss) trace with no graph break on either path (the
Triton path is a custom op `torch.ops.dmd2.*` with its backward registered; the torch path plain torch ops), and a
compiled forward + backward equals eager within float32 rounding; every custom op passes torch.library.opcheck.

Compiling is slow on a 2-core CPU (inductor: ~15 s for the block's graph), so the compiled check is one backend
per path: inductor on the torch path (inductor fuses its ops: a different arithmetic order, hence a tolerance) and
aot_eager on the Triton path. Under the interpreter (these tests on a CPU) the Triton path's ops are opaque
`custom_op`s: `triton_op` cannot trace interpreted kernels (`wrap_triton` hands back the interpreted function,
which then runs on the trace's fake tensors). On a GPU they are `triton_op`s that torch.compile decomposes into
their kernels; the last test checks that decomposition without a GPU, in a process without the interpreter.
"""
import os
import subprocess
import sys

import pytest
import torch

import dmd2_kernels
from dmd2_kernels import _utils
from test_kernels_utils import DEVICE, IMPLS, assert_close

HEAD_DIM = 8


@pytest.fixture
def dynamo():
    """torch.compile on for the test (tests/conftest.py sets TORCH_COMPILE_DISABLE for the suite), caches reset."""
    torch._dynamo.reset()
    dmd2_kernels.register_ops()  # what models/compiled.py does before it compiles (ops register lazily otherwise)
    with torch._dynamo.config.patch(disable=False):
        yield
    torch._dynamo.reset()


def block_fn(impl):
    """What a DiT / Wan block calls: adaLN modulation of the tokens, q/k norm with and without rotary."""
    def fn(x, shift, scale, q, w, cos, sin):
        return (dmd2_kernels.adaln_modulate(x, shift, scale, impl=impl),
                dmd2_kernels.qk_norm_rope(q, w, cos, sin, HEAD_DIM, impl=impl),
                dmd2_kernels.qk_norm_rope(q, w, None, None, HEAD_DIM, impl=impl))
    return fn


def block_inputs():
    """x [2, 5, 24] (H = 24: the tiled adaLN kernels), q [2, 5, 24] = 3 heads of 8; gradients for all but the tables."""
    g = torch.Generator().manual_seed(0)
    ang = 6.0 * torch.rand(5, HEAD_DIM // 2, generator=g)
    x, q = 2.0 + 3.0 * torch.randn(2, 5, 24, generator=g), 3.0 * torch.randn(2, 5, 24, generator=g)
    shift, scale = torch.randn(2, 24, generator=g), 0.5 * torch.randn(2, 24, generator=g)
    w = 1.0 + torch.randn(24, generator=g)
    leaves = [t.to(DEVICE).requires_grad_() for t in (x, shift, scale, q, w)]
    return (*leaves, ang.cos().to(DEVICE), ang.sin().to(DEVICE))


def loss_fn(impl):
    """The critic's and the actor's ops: x0 projection, CFG (no grad), the flow-matching mean, the DMD loss."""
    def fn(x_s, v, x0, eps, sigma, v_pos, v_neg):
        x0hat = dmd2_kernels.x0_from_velocity(x_s, v, sigma, impl=impl)
        with torch.no_grad():
            x0_real = dmd2_kernels.cfg_x0(x_s, v_pos, v_neg, sigma, 4.5, impl=impl)
        fm = dmd2_kernels.flow_matching_loss(v, x0, eps, sigma, space="x0", impl=impl, reduction="mean")
        loss, stats = dmd2_kernels.dmd_loss(x0hat, x0_real, x0, impl=impl)
        return loss + fm, stats.norm, stats.grad_rms, x0_real
    return fn


def loss_inputs():
    g = torch.Generator().manual_seed(1)
    t = [torch.randn(3, 4, 5, 7, generator=g).to(DEVICE) for _ in range(6)]
    sigma = (0.02 + 0.96 * torch.rand(3, generator=g)).to(DEVICE)
    return (t[0].requires_grad_(), t[1].requires_grad_(), t[2], t[3], sigma, t[4], t[5])


CASES = [(block_fn, block_inputs), (loss_fn, loss_inputs)]


def fwd_bwd(fn, args):
    """fn's outputs and the gradients of the sum of its differentiable outputs w.r.t. every leaf."""
    outs = fn(*args)
    leaves = [a for a in args if a.requires_grad]
    total = sum(o.float().sum() for o in outs if o.requires_grad)
    return [o.detach() for o in outs], torch.autograd.grad(total, leaves)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_graph_breaks(impl, dynamo, monkeypatch):
    """torch._dynamo.explain of the block's ops and of the loss ops, with requires_grad inputs: one graph each. The
    path comes from the default (DMD2_KERNELS's `_utils.DEFAULT_IMPL`), chosen while tracing."""
    monkeypatch.setattr(_utils, "DEFAULT_IMPL", impl)
    for make_fn, make_inputs in CASES:
        explained = torch._dynamo.explain(make_fn(None))(*make_inputs())
        assert explained.graph_break_count == 0 and explained.graph_count == 1, [
            b.reason for b in explained.break_reasons]


@pytest.mark.parametrize("impl", IMPLS)
def test_compiled_forward_backward_matches_eager(impl, dynamo):
    """fullgraph compile (a graph break would raise): outputs and gradients equal eager's within float32 1e-5
    (relative to each tensor's scale). The block on the torch path through inductor, everything else aot_eager."""
    for make_fn, make_inputs in CASES:
        backend = "inductor" if impl == "torch" and make_fn is block_fn else "aot_eager"
        args = make_inputs()
        want_outs, want_grads = fwd_bwd(make_fn(impl), args)
        compiled = torch.compile(make_fn(impl), backend=backend, fullgraph=True)
        got_outs, got_grads = fwd_bwd(compiled, args)
        for got, want in zip([*got_outs, *got_grads], [*want_outs, *want_grads]):
            assert_close(got, want, torch.float32, tol=(1e-5 * float(want.abs().max()), 1e-5),
                         msg=f"{make_fn.__name__} {backend}")


def opcheck_cases():
    """(op, args) for every dmd2 custom op: the forward ops with inputs that require grad (their autograd is
    registered), the backward ops with plain inputs; odd sizes, per-sample scalars as tensors and as numbers."""
    g = torch.Generator().manual_seed(2)

    def r(*shape, grad=False):
        return torch.randn(shape, generator=g).to(DEVICE).requires_grad_(grad)
    sigma, table = r(3).abs(), r(5, 4)
    ops = torch.ops.dmd2
    return [
        (ops.adaln_modulate, (r(2, 5, 24, grad=True), r(2, 24, grad=True), r(2, 24, grad=True), 1e-6)),
        (ops.adaln_modulate_bwd, (r(2, 5, 24), r(2, 5, 24), r(2, 24), r(2, 10).abs())),
        (ops.qk_norm_rope, (r(10, 16, grad=True), r(16, grad=True), table, table, 5, 8, 1e-6, "", 1)),
        (ops.qk_norm_rope_bwd, (r(10, 16), r(10, 16), r(16), None, None, r(10).abs(), 5, 8, "", 1)),
        (ops.x0_fwd, (r(3, 4, 5, grad=True), r(3, 4, 5, grad=True), sigma, 0.0)),
        (ops.x0_bwd, (r(3, 4, 5), None, 0.3)),
        (ops.cfg_x0, (r(3, 4, 5), r(3, 4, 5), r(3, 4, 5), sigma, 0.0, None, 4.5)),
        (ops.flow_matching_fwd, (r(3, 4, 5, grad=True), r(3, 4, 5), r(3, 4, 5), sigma, 0.0, True, False)),
        (ops.flow_matching_fwd, (r(3, 4, 5, grad=True), r(3, 4, 5), r(3, 4, 5), None, 0.5, True, True)),
        (ops.flow_matching_bwd, (r(3), r(3, 4, 5), r(3, 4, 5), r(3, 4, 5), sigma, 0.0, True)),
        (ops.dmd_loss, (r(3, 4, 5, grad=True), r(3, 4, 5), r(3, 4, 5))),
        (ops.dmd_loss_bwd, (r(), r(3, 4, 5), r(3, 4, 5), sigma)),
    ]


def test_custom_ops_pass_opcheck(dynamo):
    """torch.library.opcheck of every dmd2 op: schema, fake (meta) implementation, autograd registration and AOT
    dispatch with dynamic shapes agree with the real op; a failure names the op and the check."""
    for op, args in opcheck_cases():
        failed = {k: v for k, v in torch.library.opcheck(op, args, raise_exception=False).items() if v != "SUCCESS"}
        assert not failed, (op, failed)


TRACE_SCRIPT = r"""
import importlib, torch
from functorch.compile import aot_function
from dmd2_kernels import _utils
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
assert not _utils.INTERPRET
m = {n: importlib.import_module("dmd2_kernels." + n) for n in
     ("adaln", "qk_norm_rope", "x0_projection", "flow_matching", "dmd", "cfg")}
R = lambda *shape: torch.randn(shape, device="meta")
graphs = []
def compiler(gm, example_inputs):
    graphs.append(gm)
    return gm
cases = {
    "adaln": (lambda x, a, b: m["adaln"]._fwd_triton(x, a, b, 1e-6)[0], R(2, 5, 16), R(2, 16), R(2, 16)),
    "adaln_tiled": (lambda x, a, b: m["adaln"]._fwd_triton(x, a, b, 1e-6)[0], R(2, 3, 1152), R(2, 1152), R(2, 1152)),
    "adaln_bwd": (lambda dy, x, sc, st: m["adaln"]._bwd_triton(dy, x, sc, st), R(2, 5, 16), R(2, 5, 16), R(2, 16),
                  R(2, 10)),
    "qk_norm_rope": (lambda x, w, c, s: m["qk_norm_rope"]._fwd_triton(x, w, c, s, 5, 8, 1e-6, "", 1)[0], R(10, 16),
                     R(16), R(5, 4), R(5, 4)),
    "qk_norm_rope_bwd": (lambda dy, x, w, c, s, r: m["qk_norm_rope"]._bwd_triton(dy, x, w, c, s, r, 5, 8, "", 1),
                         R(10, 16), R(10, 16), R(16), R(5, 4), R(5, 4), R(10)),
    "x0_fwd": (lambda a, v, s: m["x0_projection"]._fwd_triton(a, v, s, 0.0), R(3, 4, 8), R(3, 4, 8), R(3)),
    "x0_bwd": (lambda g: m["x0_projection"]._bwd_triton(g, None, 0.3), R(3, 4, 8)),
    "cfg_x0": (lambda a, b, c, s: m["cfg"]._fwd_triton(a, b, c, s, 0.0, None, 4.5), R(3, 4, 8), R(3, 4, 8),
               R(3, 4, 8), R(3)),
    "flow_matching_fwd": (lambda v, a, b, s: m["flow_matching"]._fwd_triton(v, a, b, s, 0.0, True, True),
                          R(3, 4, 8), R(3, 4, 8), R(3, 4, 8), R(3)),
    "flow_matching_bwd": (lambda g, v, a, b: m["flow_matching"]._bwd_triton(g, v, a, b, None, 0.5, True), R(3),
                          R(3, 4, 8), R(3, 4, 8), R(3, 4, 8)),
    "dmd_loss": (lambda v, a, b: m["dmd"]._fwd_triton(v, a, b)[0], R(3, 4, 8), R(3, 4, 8), R(3, 4, 8)),
    "dmd_loss_bwd": (lambda g, a, b, n: m["dmd"]._bwd_triton(g, a, b, n), R(), R(3, 4, 8), R(3, 4, 8), R(3)),
}
for name, (fn, *args) in cases.items():
    graphs.clear()
    try:
        aot_function(fn, fw_compiler=compiler)(*args)
    except Exception:  # running the traced graph launches the kernels: no GPU here; the trace is what is checked
        pass
    nodes = [n for n in graphs[0].graph.nodes if n.op == "call_function"]
    launched = [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__ for n in nodes
                if "triton_kernel_wrapper" in str(n.target)]
    left = [str(n.target) for n in nodes if "dmd2" in str(n.target)]
    print(name, ",".join(launched), ",".join(left) or "-")
"""

EXPECTED_LAUNCHES = {
    "adaln": "_adaln_fwd_kernel", "adaln_tiled": "_adaln_fwd_tiled_kernel", "adaln_bwd": "_adaln_bwd_kernel",
    "qk_norm_rope": "_sumsq_kernel,_fwd_kernel", "qk_norm_rope_bwd": "_bwd_rowsum_kernel,_bwd_dx_kernel",
    "x0_fwd": "_x0_fwd_kernel", "x0_bwd": "_x0_bwd_kernel", "cfg_x0": "_cfg_x0_fwd_kernel",
    "flow_matching_fwd": "_fm_fwd_kernel,_fm_final_kernel", "flow_matching_bwd": "_fm_bwd_kernel",
    "dmd_loss": "_dmd_norm_kernel,_dmd_fwd_kernel", "dmd_loss_bwd": "_dmd_bwd_kernel",
}


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_triton_ops_trace_into_their_kernels_for_the_gpu_compiler():
    """Without the interpreter (the GPU's case) each op is a `triton_op`: AOT autograd, which torch.compile runs,
    decomposes it into its kernels (a `triton_kernel_wrapper` node per launch, no dmd2 op left), so inductor
    sees and schedules them. Traced on meta tensors in a process without TRITON_INTERPRET (no GPU is needed to
    trace; the joint forward + backward graph needs one, for inductor's analysis of what a kernel writes, so each
    direction's op is traced as a forward)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", TRACE_SCRIPT], env=env, cwd=repo, capture_output=True, text=True,
                         timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    traced = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line)
    assert traced == {name: f"{launches} -" for name, launches in EXPECTED_LAUNCHES.items()}, out.stdout
