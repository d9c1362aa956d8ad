"""No torch.distributed collective of a TP=2 x DP=2 teacher step, DMD2 cycle (GAN + EMA), eval and save
receives a tensor made on the host (see tests/mp_scripts/collectives_on_device.py for the provenance
check that makes this testable on CPU); and the check itself catches a planted host-tensor all_reduce."""
import json
import os

import pytest

from tests.utils import MP_SCRIPTS, torchrun

pytestmark = pytest.mark.timeout(400)
SCRIPT = os.path.join(MP_SCRIPTS, "collectives_on_device.py")


def collect(out, plant: bool) -> list:
    res = torchrun(4, SCRIPT, ["--out", str(out)] + (["--plant"] if plant else []), timeout=360)
    res.check("TP=2 x DP=2 teacher + DMD2 run under the collective check")
    logs = [json.load(open(out / f"{r}.json")) for r in range(4)]
    assert all(log["checked"] > 20 for log in logs), [log["checked"] for log in logs]  # the wrappers saw traffic
    return [v for log in logs for v in log["violations"]]


def test_collectives_receive_device_tensors_only(tmp_path):
    violations = collect(tmp_path, plant=False)
    assert not violations, "collective on a host-made tensor:\n" + "\n".join(v["where"] for v in violations[:3])


def test_the_check_catches_a_host_tensor(tmp_path):
    violations = collect(tmp_path, plant=True)
    assert len(violations) == 4 and all(v["collective"] == "all_reduce" for v in violations), violations
