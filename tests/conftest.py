"""Test-wide settings (no torch.compile, one BLAS thread per process, the repo on sys.path, the Triton
interpreter where there is no CUDA device), the shared teacher fixture, and the two tiers.

TRITON_INTERPRET must be set before anything imports triton; it is set only without CUDA, so that on
a GPU the kernel tests run the compiled kernels (and the CUDA-only test runs). An explicit
TRITON_INTERPRET in the environment wins.

Tiers (docs/testing.md): a test that launches a process (a launch/ script, torchrun, a shell script, a CLI
module) is marked `integration`; `bash tests/run.sh --fast` runs the rest (`-m "not integration"`). The mark is
checked, not trusted: an unmarked test that starts a process fails naming the mark, and under the fast tier
(DMD2_TEST_TIER=fast) so does any fixture, except the session's one debug teacher.
"""
import contextlib
import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.forkserver import ForkedRun  # noqa: E402
from tests.utils import train_debug_teacher  # noqa: E402

INTEGRATION = "integration"
_STARTS = ((subprocess.Popen, subprocess.Popen.__init__), (ForkedRun, ForkedRun.__init__))  # what starts a process


def pytest_configure(config):
    config.addinivalue_line("markers", f"{INTEGRATION}: launches a process (a script, torchrun, a shell); "
                                       "`bash tests/run.sh --fast` skips it")


def pytest_collection_modifyitems(config, items):
    """A module's `INTEGRATION_FIXTURES` (names of its fixtures that launch processes) mark every test using one."""
    for item in items:
        names = getattr(item.module, "INTEGRATION_FIXTURES", ())
        if any(n in item.fixturenames for n in names):
            item.add_marker(INTEGRATION)


@contextlib.contextmanager
def _starts(inits: list):
    """Each of _STARTS' classes gets the matching __init__ while the block runs."""
    saved = [cls.__init__ for cls, _ in _STARTS]
    for (cls, _), init in zip(_STARTS, inits):
        cls.__init__ = init
    try:
        yield
    finally:
        for (cls, _), init in zip(_STARTS, saved):
            cls.__init__ = init


def _no_processes(what: str):
    def refuse(self, args, *a, **kw):
        raise AssertionError(f"{what} started a process ({args!r}): mark the test @pytest.mark.{INTEGRATION} "
                             "(tests/conftest.py)")
    return _starts([refuse] * len(_STARTS))


def _processes_allowed():
    return _starts([init for _, init in _STARTS])


@pytest.fixture(scope="session", autouse=True)
def _fast_tier_starts_no_process():
    """Under the fast tier every fixture too is refused a process (the debug teacher excepted)."""
    if os.environ.get("DMD2_TEST_TIER") != "fast":
        yield
        return
    with _no_processes("a fixture of the fast tier"):
        yield


@pytest.fixture(autouse=True)
def _unmarked_tests_start_no_process(request):
    if request.node.get_closest_marker(INTEGRATION) is not None:
        yield
        return
    with _no_processes(f"{request.node.nodeid}, not marked {INTEGRATION},"):
        yield


@pytest.fixture(scope="session")
def debug_teacher(tmp_path_factory) -> str:
    """The DMD2 tests' teacher, trained once per session (per xdist worker): `tests.utils.train_debug_teacher` (10
    AdamW steps of the debug DiT on digits, micro-batch 8, lr 3e-3, seed 5; deterministic). Tests only read it. Its
    one training process is allowed in either tier."""
    with _processes_allowed():
        return train_debug_teacher(str(tmp_path_factory.mktemp("debug_teacher") / "teacher"))
