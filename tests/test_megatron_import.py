"""dmd2_mega/megatron_import.py: importing the package filters megatron-core's four "Transformer Engine and Apex are
not installed" UserWarnings (and nothing else), and switches megatron-core's jit fuser off before megatron-core loads
(no torch._dynamo / torch._inductor import: half of a process's start-up), megatron-core's fused functions stay
callable and give their eager values, DMD2_MEGA_MEGATRON_JIT=1 keeps megatron-core's torch.compile fuser, and a
megatron.core imported before dmd2_mega is left as it is. Each case is a fresh interpreter (this one has megatron-core
loaded already)."""
import json
import sys

import pytest

from tests.utils import run, run_parallel

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PROBE = """
import json, sys
{first}
import dmd2_mega.models  # imports megatron-core (the parallel linears)
import torch
from megatron.core.fusions.fused_bias_gelu import bias_gelu
from dmd2_mega.megatron_import import fuser_state
x, b = torch.randn(3, 5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
y = x + b
want = y * 0.5 * (1.0 + torch.tanh(0.79788456 * y * (1 + 0.044715 * y * y)))  # megatron's tanh GeLU, by hand
print(json.dumps({{"state": fuser_state(), "dynamo": "torch._dynamo" in sys.modules,
                  "gelu_err": float((bias_gelu(b, x) - want).abs().max())}}))
"""


def probe(first: str = "", env=None) -> dict:
    res = run([sys.executable, "-c", PROBE.format(first=first)], extra_env=env).check("megatron_import probe")
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_fuser_off_by_default_kept_on_request_or_when_megatron_came_first():
    got = run_parallel({"default": lambda: probe(),
                        "env": lambda: probe(env={"DMD2_MEGA_MEGATRON_JIT": "1"}),
                        "first": lambda: probe(first="import megatron.core")}, workers=3)
    assert got["default"]["state"] == "off" and not got["default"]["dynamo"], got["default"]
    assert got["default"]["gelu_err"] <= 1e-12, got["default"]  # the decorated function runs, eagerly
    assert got["env"]["state"] == "torch.compile" and got["env"]["dynamo"], got["env"]
    assert got["first"]["state"] == "torch.compile", got["first"]


WARNINGS_PROBE = """
import warnings
{first}
import dmd2_mega.methods.dmd2.method  # megatron-core's optimizer, clip_grads, FSDP mixed precision
warnings.warn("Transformer Engine and Apex are not installed. (from __main__: not megatron's, still shown)")
"""


def test_megatron_extras_warnings_filtered_exactly():
    env = {"PYTHONWARNINGS": "default"}  # the tests' children ignore warnings otherwise
    got = run_parallel({k: lambda first=first: run([sys.executable, "-c", WARNINGS_PROBE.format(first=first)],
                                           extra_env=env).check("warnings probe").stderr
                        for k, first in (("ours", ""), ("megatron first", "import megatron.core.optimizer"))})
    assert got["ours"].count("Transformer Engine and Apex are not installed") == 1, got["ours"]
    assert "still shown" in got["ours"], got["ours"]
    assert got["megatron first"].count("Transformer Engine and Apex are not installed") >= 3, got["megatron first"]
