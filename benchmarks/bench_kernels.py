"""Microbenchmarks of the fused DMD2 kernels (kernels/) against eager torch and torch.compile.

    python benchmarks/bench_kernels.py [--csv kernels.csv] [--ops x0,cfg,fm,dmd,adaln,qknorm]
                                       [--dtype bfloat16] [--large | --no-large] [--no-compile]

For each op and mode (fwd; fwd+bwd where the op has a backward) at realistic sizes
  elementwise ops: SDXL latent 4x128x128 at B=8, Wan 480p latent 16x21x60x104 at B=1;
  adaln:           the DiT token streams of those latents: DiT-XL/2 [8, 4096, 1152] and
                   Wan2.1-1.3B [1, 32760, 1536] (patch 1x2x2, hidden 1536);
  qknorm:          Wan2.1-1.3B's q at 480p, [1, 32760, 1536] = 12 heads of head_dim 128, with rotary
                   (cos, sin [32760, 64] float32), at TP = 1 (no collective);
and a large sweep (2^26 and, on CUDA, 2^28 elements), it reports the fused time (p50, p20, p80,
ms), the eager-torch time of the same maths (the package's ``*_ref``, autograd through plain torch
ops), the ``torch.compile`` time of that reference, the bytes the fused op must move (model below),
its GB/s, the percentage of the device-to-device copy bandwidth measured in the same run, and the path the
default dispatch takes on CUDA at that op, mode and size (`cuda_dispatch`: `dmd2_kernels._utils.FUSED_FROM`).

Bytes moved (N = elements, s = bytes per element; small [B] / [B, H] tensors ignored), each op's `PASSES` (its
module's docstring says which reads and writes they are):
  x0 fwd 3Ns, fwd+bwd 5Ns (backward: read grad, write grad_v; grad_x_s is grad itself);
  cfg fwd 4Ns; fm fwd 3Ns, fwd+bwd 7Ns; dmd fwd 4Ns (two passes of 2 reads), fwd+bwd 7Ns;
  adaln fwd 2Ns, fwd+bwd 5Ns (backward reads x and dy, writes dx);
  qknorm fwd 3Ns, fwd+bwd 8Ns: the bytes its two-pass kernels move (the TP all-reduce of the row sums
  sits between the passes): forward reads x twice and writes y, backward reads x and dy twice and
  writes dx (the one-pass minimum would be 2Ns, 5Ns; the [S, 64] cos / sin tables are ignored).
On CUDA the fused path is Triton, timed with triton.testing.do_bench (L2 flushed before each run).
On CPU the fused column is the package's torch path (few-op formulation): Triton is NOT timed on
CPU, where it only runs in the interpreter, which is no speed path. The large sweep is opt-in on CPU
(--large). torch.compile uses dynamic shapes so that one compile serves a rank of sizes.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

import dmd2_kernels  # noqa: E402
from dmd2_kernels import _utils as kernel_utils  # noqa: E402

# each fused op's bytes moved (its module's `PASSES`; the package's names `qk_norm_rope` etc. are the ops themselves)
PASSES = {m: sys.modules[f"dmd2_kernels.{m}"].PASSES
          for m in ("x0_projection", "cfg", "flow_matching", "dmd", "adaln", "qk_norm_rope")}


@dataclass
class Op:
    name: str
    modes: tuple[str, ...]
    passes: dict[str, int]  # mode -> full-size tensor reads + writes of the fused op
    make: Callable  # (shape, dtype, device) -> dict of inputs
    diff: tuple[str, ...]  # inputs differentiated in fwd+bwd
    fused: Callable  # (inputs, impl) -> output (first element is differentiated)
    ref: Callable  # inputs -> output


def _rand(shape, dtype, device, gen, scale=1.0):
    return (scale * torch.randn(shape, generator=gen, device=device)).to(dtype)


def _latent_inputs(names):
    def make(shape, dtype, device):
        gen = torch.Generator(device=device).manual_seed(0)
        inp = {n: _rand(shape, dtype, device, gen) for n in names}
        inp["sigma"] = 0.02 + 0.96 * torch.rand(shape[0], generator=gen, device=device)
        inp["guidance"] = torch.full((shape[0],), 4.5, device=device)
        return inp
    return make


def _dmd_inputs(shape, dtype, device):
    gen = torch.Generator(device=device).manual_seed(0)
    x0hat = _rand(shape, torch.float32, device, gen)
    real = x0hat + _rand(shape, torch.float32, device, gen, 0.3)
    fake = real + _rand(shape, torch.float32, device, gen, 0.1)
    return {"x0hat": x0hat.to(dtype), "x0_real": real.to(dtype), "x0_fake": fake.to(dtype)}


def _adaln_inputs(shape, dtype, device):
    gen = torch.Generator(device=device).manual_seed(0)
    B, H = shape[0], shape[-1]
    return {"x": _rand(shape, dtype, device, gen), "shift": _rand((B, H), dtype, device, gen),
            "scale": _rand((B, H), dtype, device, gen, 0.5)}


QK_HEAD_DIM = 128  # Wan's head_dim


def _qknorm_inputs(shape, dtype, device):
    """x [B, S, HL], weight [HL], and rotary tables cos, sin [S, HEAD_DIM / 2] float32 (RoPE angles s * theta_j)."""
    gen = torch.Generator(device=device).manual_seed(0)
    S, HL = shape[1], shape[-1]
    theta = 10000.0 ** (-torch.arange(0, QK_HEAD_DIM, 2, device=device, dtype=torch.float32) / QK_HEAD_DIM)
    ang = torch.arange(S, device=device, dtype=torch.float32)[:, None] * theta
    return {"x": _rand(shape, dtype, device, gen), "weight": 1.0 + _rand((HL,), dtype, device, gen, 0.1),
            "cos": ang.cos(), "sin": ang.sin()}


OPS = {
    "x0": Op("x0_from_velocity", ("fwd", "fwd+bwd"), PASSES["x0_projection"], _latent_inputs(["x_s", "v"]),
             ("x_s", "v"), lambda i, impl: dmd2_kernels.x0_from_velocity(i["x_s"], i["v"], i["sigma"], impl=impl),
             lambda i: dmd2_kernels.x0_from_velocity_ref(i["x_s"], i["v"], i["sigma"])),
    "cfg": Op("cfg_x0", ("fwd",), PASSES["cfg"], _latent_inputs(["x_s", "v_pos", "v_neg"]), (),
              lambda i, impl: dmd2_kernels.cfg_x0(i["x_s"], i["v_pos"], i["v_neg"], i["sigma"], i["guidance"],
                                                  impl=impl),
              lambda i: dmd2_kernels.cfg_x0_ref(i["x_s"], i["v_pos"], i["v_neg"], i["sigma"], i["guidance"])),
    "fm": Op("flow_matching_loss", ("fwd", "fwd+bwd"), PASSES["flow_matching"],
             _latent_inputs(["v_pred", "x0", "eps"]), ("v_pred",),
             lambda i, impl: dmd2_kernels.flow_matching_loss(i["v_pred"], i["x0"], i["eps"], i["sigma"], impl=impl),
             lambda i: dmd2_kernels.flow_matching_loss_ref(i["v_pred"], i["x0"], i["eps"], i["sigma"])),
    "dmd": Op("dmd_loss", ("fwd", "fwd+bwd"), PASSES["dmd"], _dmd_inputs, ("x0hat",),
              lambda i, impl: dmd2_kernels.dmd_loss(i["x0hat"], i["x0_real"], i["x0_fake"], impl=impl),
              lambda i: dmd2_kernels.dmd_loss_ref(i["x0hat"], i["x0_real"], i["x0_fake"])),
    "adaln": Op("adaln_modulate", ("fwd", "fwd+bwd"), PASSES["adaln"], _adaln_inputs, ("x", "shift", "scale"),
                lambda i, impl: dmd2_kernels.adaln_modulate(i["x"], i["shift"], i["scale"], impl=impl),
                lambda i: dmd2_kernels.adaln_modulate_ref(i["x"], i["shift"], i["scale"])),
    "qknorm": Op("qk_norm_rope", ("fwd", "fwd+bwd"), PASSES["qk_norm_rope"], _qknorm_inputs, ("x", "weight"),
                 lambda i, impl: dmd2_kernels.qk_norm_rope(i["x"], i["weight"], i["cos"], i["sin"], QK_HEAD_DIM,
                                                           impl=impl),
                 lambda i: dmd2_kernels.qk_norm_rope_ref(i["x"], i["weight"], i["cos"], i["sin"], QK_HEAD_DIM)),
}
KIND = {"adaln": "tokens", "qknorm": "qk"}  # op -> its sizes below; the others take "latent"
REALISTIC = {"latent": [("sdxl B8", (8, 4, 128, 128)), ("wan480p B1", (1, 16, 21, 60, 104))],
             "tokens": [("dit-xl2 sdxl B8", (8, 4096, 1152)), ("wan1.3b 480p B1", (1, 32760, 1536))],
             "qk": [("wan1.3b q 480p B1", (1, 32760, 1536))]}
LARGE = {"latent": [("2^26", (4, 16, 1024, 1024)), ("2^28", (16, 16, 1024, 1024))],
         "tokens": [("2^26", (16, 4096, 1024)), ("2^28", (64, 4096, 1024))],
         "qk": [("2^26", (16, 4096, 1024)), ("2^28", (64, 4096, 1024))]}


def first(out):
    return out[0] if isinstance(out, tuple) else out


def make_runner(fn, inputs, diff, mode):
    """A closure running ``fn`` once: under no_grad for fwd, with autograd.grad for fwd+bwd."""
    if mode == "fwd":
        def run():
            with torch.no_grad():
                fn(inputs)
        return run
    leaves = [inputs[k] for k in diff]
    grad_out = torch.ones_like(first(fn(inputs)))

    def run():
        torch.autograd.grad(first(fn(inputs)), leaves, grad_out)
    return run


def bench_cpu(runs, warmup_ms, rep_ms, min_reps=3):
    """Wall-clock (p50, p20, p80) ms of each closure, timed round-robin so that load from other
    processes on a shared CPU hits every variant alike."""
    for run in runs:
        run()
    end = time.perf_counter() + warmup_ms / 1e3
    while time.perf_counter() < end:
        for run in runs:
            run()
    times = [[] for _ in runs]
    while len(times[0]) < min_reps or (sum(map(sum, times)) < rep_ms * len(runs) and len(times[0]) < 1000):
        for run, ts in zip(runs, times):
            t0 = time.perf_counter()
            run()
            ts.append((time.perf_counter() - t0) * 1e3)
    return [torch.tensor(ts).quantile(torch.tensor([0.5, 0.2, 0.8])).tolist() for ts in times]


def bench(runs, device, args):
    """(p50, p20, p80) ms per closure: triton.testing.do_bench on CUDA, bench_cpu on CPU."""
    if device.type == "cuda":
        return [triton.testing.do_bench(run, warmup=args.warmup, rep=args.rep, quantiles=[0.5, 0.2, 0.8])
                for run in runs]
    return bench_cpu(runs, args.warmup, args.rep)


def copy_bandwidth(device, args):
    """Device-to-device copy GB/s (read + write) of a buffer far larger than the caches."""
    nbytes = 2 ** 29 if device.type == "cuda" else 2 ** 26
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    p50 = bench([lambda: dst.copy_(src)], device, args)[0][0]
    return 2 * nbytes / (p50 * 1e-3) / 1e9


def compile_disabled():
    return os.environ.get("TORCH_COMPILE_DISABLE", "") not in ("", "0")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--csv", metavar="PATH", help="also write the table as CSV")
    p.add_argument("--ops", default=",".join(OPS), help="comma list of " + ",".join(OPS))
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", default=None, help="default cuda if available, else cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: on a shared machine, multi-threaded ops stall while one "
                        "of their threads is descheduled; 0 keeps torch's default)")
    p.add_argument("--large", dest="large", action="store_true", default=None,
                   help="run the large sweep (default on CUDA only; 2^26 only on CPU)")
    p.add_argument("--no-large", dest="large", action="store_false")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    p.add_argument("--warmup", type=int, default=25, help="warm-up per measurement, ms")
    p.add_argument("--rep", type=int, default=100, help="timed repetitions per measurement, ms")
    return p.parse_args(argv)


COLUMNS = ["op", "mode", "size", "shape", "dtype", "elements", "fused_p50_ms", "fused_p20_ms", "fused_p80_ms",
           "eager_ms", "compile_ms", "x_eager", "x_compile", "MB", "GB_s", "pct_copy", "cuda_dispatch"]
# each benchmark op's name in the dispatcher (`dmd2_kernels._utils.FUSED_FROM`)
DISPATCH_OP = {"x0": "x0", "cfg": "cfg", "fm": "flow_matching", "dmd": "dmd", "adaln": "adaln",
               "qknorm": "qk_norm_rope"}


def cuda_dispatch(key: str, mode: str, n: int) -> str:
    """The path the default dispatch takes on CUDA for this op, mode and size (`_utils.fused_pays`)."""
    probe = torch.empty(n, device="meta", requires_grad=mode == "fwd+bwd")
    return "triton" if kernel_utils.fused_pays(DISPATCH_OP[key], probe) else "torch"


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if not cuda and args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    large = cuda if args.large is None else args.large
    impl = "triton" if cuda else "torch"
    use_compile = not args.no_compile and not compile_disabled()
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise SystemExit(f"--ops: unknown {bad}; choose from {list(OPS)}")

    name = torch.cuda.get_device_name(device) if cuda else f"CPU ({torch.get_num_threads()} threads)"
    print(f"device: {name} | torch {torch.__version__} | triton {triton.__version__} | dtype {dtype}")
    if cuda:
        print("fused = Triton kernels (kernels/), timed with triton.testing.do_bench")
    else:
        print("fused = the kernels' torch path. Triton is NOT timed on CPU: it only runs in the interpreter, "
              "which is no speed path.")
    if not use_compile:
        why = "--no-compile" if args.no_compile else "TORCH_COMPILE_DISABLE is set"
        print(f"torch.compile: skipped ({why})")
    copy_gbs = copy_bandwidth(device, args)
    print(f"device-to-device copy bandwidth: {copy_gbs:.1f} GB/s")

    rows = []
    for key in ops:
        op = OPS[key]
        kind = KIND.get(key, "latent")
        sizes = [(label, shape, False) for label, shape in REALISTIC[kind]]
        if large:
            sizes += [(label, shape, True) for label, shape in LARGE[kind][: (2 if cuda else 1)]]
        for mode in op.modes:
            compiled = torch.compile(op.ref, dynamic=True) if use_compile else None
            for label, shape, is_large in sizes:
                inputs = op.make(shape, dtype, device)
                if mode == "fwd+bwd":
                    for k in op.diff:
                        inputs[k].requires_grad_(True)
                runs = [make_runner(lambda i: op.fused(i, impl), inputs, op.diff, mode),
                        make_runner(op.ref, inputs, op.diff, mode)]
                if compiled is not None:
                    try:  # the first call compiles
                        runs.append(make_runner(compiled, inputs, op.diff, mode))
                        runs[-1]()
                    except Exception as exc:  # a missing C++ compiler etc.: report, keep going
                        print(f"torch.compile failed for {op.name} {mode} {shape}: {type(exc).__name__}: {exc}")
                        compiled = None
                        runs = runs[:2]
                times = bench(runs, device, args)
                fused, eager = times[0], times[1][0]
                comp = times[2][0] if len(times) > 2 else float("nan")
                n = torch.Size(shape).numel()
                nbytes = op.passes[mode] * n * dtype.itemsize
                gbs = nbytes / (fused[0] * 1e-3) / 1e9
                rows.append({"op": op.name, "mode": mode, "size": label, "shape": "x".join(map(str, shape)),
                             "dtype": str(dtype).replace("torch.", ""), "elements": n, "fused_p50_ms": fused[0],
                             "fused_p20_ms": fused[1], "fused_p80_ms": fused[2], "eager_ms": eager, "compile_ms": comp,
                             "x_eager": eager / fused[0], "x_compile": comp / fused[0], "MB": nbytes / 1e6,
                             "GB_s": gbs, "pct_copy": 100 * gbs / copy_gbs, "large": is_large,
                             "cuda_dispatch": cuda_dispatch(key, mode, n)})
                del inputs
                if cuda:
                    torch.cuda.empty_cache()
    print_table(rows)
    if cuda:
        summarize(rows)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["device"] + COLUMNS)
            w.writeheader()
            for r in rows:
                w.writerow({"device": name, **{c: r[c] for c in COLUMNS}})
        print(f"wrote {args.csv}")


def fmt(v):
    if isinstance(v, float):
        return "n/a" if v != v else (f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}")
    return str(v)


def print_table(rows):
    head = ["op", "mode", "size", "shape", "fused_p50_ms", "fused_p20_ms", "fused_p80_ms", "eager_ms",
            "compile_ms", "x_eager", "x_compile", "MB", "GB_s", "pct_copy", "cuda_dispatch"]
    cells = [head] + [[fmt(r[c]) for c in head] for r in rows]
    widths = [max(len(row[j]) for row in cells) for j in range(len(head))]
    for i, row in enumerate(cells):
        print("  ".join(c.rjust(w) if j >= 4 else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def summarize(rows):
    """Acceptance of issue 3 on a GPU: >= 85% of copy bandwidth at the large sizes, faster than
    eager at the realistic sizes."""
    fails = [f"{r['op']} {r['mode']} {r['size']}: {r['pct_copy']:.0f}% of copy" for r in rows
             if r["large"] and r["pct_copy"] < 85]
    fails += [f"{r['op']} {r['mode']} {r['size']}: {r['x_eager']:.2f}x eager" for r in rows
              if not r["large"] and r["x_eager"] <= 1.0]
    print("acceptance: " + ("all rows pass" if not fails else "FAIL\n  " + "\n  ".join(fails)))


if __name__ == "__main__":
    main()
