"""--bf16 DMD2 (it casts the parameters; it is not autocast):
  a. in-process, with the GAN head and the EMA on: every parameter of every role (the GAN head included)
     is bf16, the trained roles' optimizers keep fp32 master weights, every DiT block of every role
     computes in bf16 during a cycle (forward hooks), and the cycle's metrics are finite;
  b. through launch/pretrain_dmd2.py: 3 cycles track the fp32 run's critic loss within 5% and differ
     from it (an ignored --bf16 would give the fp32 trace exactly).
"""
import math

import pytest
import torch

from dmd2_mega.arguments import parse_dmd2_args
from dmd2_mega.methods.dmd2.method import DMD2Trainer
from dmd2_mega.models.dit import DiTBlock
from tests.utils import PRETRAIN_DMD2, python, read_trace, world_of_one

pytestmark = pytest.mark.timeout(300)
ARGS = ["--model-size", "debug", "--train-iters", "3", "--micro-batch-size", "4", "--dmd2-critic-steps-per-rollout",
        "2", "--dmd2-teacher-guidance-scale", "1.5", "--log-interval", "1", "--offload-inactive"]


def test_bf16_casts_every_role_keeps_fp32_masters_and_computes_in_bf16(debug_teacher):
    with world_of_one():
        tr = DMD2Trainer(parse_dmd2_args(ARGS + ["--teacher-load", debug_teacher, "--bf16", "--dmd2-gan",
                                                 "--ema-decay", "0.9"]))
        for name, role in tr.roles.items():
            dtypes = {p.dtype for p in role.model.parameters()}
            assert dtypes == {torch.bfloat16}, f"{name} parameters: {dtypes}"
        assert any(n.startswith("head.") for n, _ in tr.roles["critic"].model.named_parameters())
        for name in ("student", "critic"):
            masters = tr.roles[name].optimizer.master_params
            assert masters and all(m.dtype == torch.float32 for m in masters), f"{name}: fp32 masters"
            assert len(masters) == len([p for p in tr.roles[name].model.parameters() if p.requires_grad])
        seen = {name: set() for name in tr.roles}
        hooks = [m.register_forward_hook(lambda mod, inp, out, name=name: seen[name].add(out.dtype))
                 for name, role in tr.roles.items() for m in role.model.modules() if isinstance(m, DiTBlock)]
        out = tr.cycle()
        for h in hooks:
            h.remove()
        assert seen == {n: {torch.bfloat16} for n in tr.roles}, seen
        vals = {k: float(v) for k, v in out["metrics"].items()}
        assert all(math.isfinite(v) for v in vals.values()), vals


@pytest.mark.integration
def test_bf16_trace_tracks_fp32_and_differs(tmp_path, debug_teacher):
    traces = {}
    for name, extra in (("fp32", []), ("bf16", ["--bf16"])):
        trace = tmp_path / f"{name}.jsonl"
        python(PRETRAIN_DMD2, ARGS + ["--teacher-load", debug_teacher, "--loss-trace", str(trace), *extra]
               ).check(f"{name} DMD2")
        traces[name] = read_trace(str(trace))
    assert len(traces["bf16"]) == len(traces["fp32"]) == 3
    for a, b in zip(traces["fp32"], traces["bf16"]):
        # bf16 rounding (8 bits of mantissa) moves the losses by well under 5%, never to NaN
        assert b["critic-loss"] == pytest.approx(a["critic-loss"], rel=5e-2)
    assert any(a["critic-loss"] != b["critic-loss"] for a, b in zip(traces["fp32"], traces["bf16"])), \
        "the bf16 trace equals the fp32 one: --bf16 was ignored"
