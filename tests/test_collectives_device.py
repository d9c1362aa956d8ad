"""No torch.distributed collective of a TP=2 x DP=2 teacher step, DMD2 cycle (GAN + EMA), eval and save
receives a tensor made on the host (see tests/mp_scripts/collectives_on_device.py for the provenance
check that makes this testable on CPU); and the check itself catches a planted host-tensor all_reduce."""
import json
import os

import pytest

from tests.utils import MP_SCRIPTS, torchrun

pytestmark = pytest.mark.timeout(400)
INTEGRATION_FIXTURES = ("logs",)  # fixtures that launch processes: their tests are marked integration
SCRIPT = os.path.join(MP_SCRIPTS, "collectives_on_device.py")


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> list:
    """One TP=2 x DP=2 run: the trainers' collectives, then the planted host-tensor all_reduce."""
    out = tmp_path_factory.mktemp("collectives")
    res = torchrun(4, SCRIPT, ["--out", str(out)], timeout=360)
    res.check("TP=2 x DP=2 teacher + DMD2 run under the collective check")
    logs = [json.load(open(out / f"{r}.json")) for r in range(4)]
    assert all(log["checked"] > 20 for log in logs), [log["checked"] for log in logs]  # the wrappers saw traffic
    return logs


def test_collectives_receive_device_tensors_only(logs):
    violations = [v for log in logs for v in log["violations"]]
    assert not violations, "collective on a host-made tensor:\n" + "\n".join(v["where"] for v in violations[:3])


def test_the_check_catches_a_host_tensor(logs):
    planted = [v for log in logs for v in log["planted"]]
    assert len(planted) == 4 and all(v["collective"] == "all_reduce" for v in planted), planted
