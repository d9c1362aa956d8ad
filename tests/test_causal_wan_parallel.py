"""The causal Wan student under TP / CP / SP (issue 29 item 2): both paths at TP = 2, CP = 2 and TP = 2 x CP = 2
with sequence parallelism equal TP = 1 (fp32, 1e-5 relative): the parallel pass's output, GAN features, loss and
every gradient, and the KV-cached stream's output (the cache sharded by heads under TP; under CP on the rank that
holds its heads after the all-to-all). tests/mp_scripts/causal_wan_parallel.py runs each layout, for chunks of 2
frames and for frame-wise chunks with a rolling window and a sink.
"""
import os

import pytest
import torch

from tests.test_token_parallel import assert_same
from tests.utils import MP_SCRIPTS, torchrun

pytestmark = [pytest.mark.timeout(600), pytest.mark.integration]
SCRIPT = os.path.join(MP_SCRIPTS, "causal_wan_parallel.py")
CAUSAL = ("chunk2", "window")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("causal_parallel")
    torchrun(2, SCRIPT, ["--out", d, "ref:1:1:0", "tp2:2:1:0", "cp2:1:2:0"]).check("2 ranks")
    torchrun(4, SCRIPT, ["--out", d, "all:2:2:1"]).check("4 ranks")
    return {(name, c): torch.load(d / f"{name}-{c}.pt") for name in ("ref", "tp2", "cp2", "all") for c in CAUSAL}


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("layout", ["tp2", "cp2", "all"])
def test_both_paths_equal_tp1(runs, layout, causal):
    got, want = runs[(layout, causal)], runs[("ref", causal)]
    assert_same(got, want, 1e-5, f"{layout} vs TP=1 ({causal})")
    err = float((got["stream"] - want["stream"]).abs().max())
    assert err <= 1e-5 * float(want["stream"].abs().max()), f"{layout} ({causal}): the stream differs by {err:.3e}"


@pytest.mark.parametrize("causal", CAUSAL)
def test_the_stream_equals_the_parallel_pass(runs, causal):
    r = runs[("all", causal)]
    assert float((r["stream"] - r["out"]).abs().max()) <= 1e-5 * float(r["out"].abs().max())
