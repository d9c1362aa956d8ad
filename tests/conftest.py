"""Test-wide settings (no torch.compile, one BLAS thread per process, the repo on sys.path, the Triton
interpreter where there is no CUDA device), the shared teacher fixture, and the two tiers.

TRITON_INTERPRET must be set before anything imports triton; it is set only without CUDA, so that on
a GPU the kernel tests run the compiled kernels (and the CUDA-only test runs). An explicit
TRITON_INTERPRET in the environment wins.

Tiers (docs/testing.md): a test that launches a process (a launch/ script, torchrun, a shell script, a CLI
module) is marked `integration`; `bash tests/run.sh --fast` runs the rest (`-m "not integration"`). The mark is
checked, not trusted: an unmarked test that starts a process fails naming the mark, and under the fast tier
(DMD2_TEST_TIER=fast) so does any fixture, except the session's one debug teacher. Only the test's processes count:
one that the CUDA / Triton / torch toolchain starts on its own behalf (ldconfig, ptxas, inductor's compile workers,
a C++ compiler) passes; a launch of ours never does, whoever starts it (`_the_toolchains`).
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


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OURS = ("dmd2_mega", "kernels", "launch", "benchmarks", "tests")  # our packages, and the folders of our scripts
_OUR_DIRS = tuple(os.path.join(REPO, d) + os.sep for d in _OURS)
_SCRIPT = (".py", ".sh", ".sbatch")
_TORCHRUN = ("torchrun", "torch.distributed.run", "torch.distributed.launch")
_TOOLCHAIN = ("triton", "torch", "cuda", "nvidia", "cupy")  # packages that start processes on their own behalf
_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch", "torch.distributed.launcher",
              "torch.distributed.elastic", "torch.multiprocessing")  # ... except torch's launchers: the test's


def _within(module: str, packages: tuple) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _caller(frame) -> str:
    """The module of the first frame, from `frame` outwards, outside the standard library (subprocess,
    multiprocessing, concurrent.futures, os, threading, functools, contextlib, ...)."""
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in sys.stdlib_module_names:
        frame = frame.f_back
    return frame.f_globals.get("__name__", "?") if frame is not None else "?"


def _launch_of_ours(args, cwd) -> bool:
    """`args` runs a script of ours (.py / .sh / .sbatch under _OURS' folders), torchrun, or `-m` of our package."""
    argv = [os.fsdecode(a) for a in ([args] if isinstance(args, (str, bytes, os.PathLike)) else args)]
    words = argv + [w.strip("'\"") for a in argv for w in a.split()]  # and the words of a shell's command line
    bases = (os.fsdecode(cwd or os.getcwd()), REPO)
    for prev, word in zip([""] + words, words):
        if os.path.basename(word) in _TORCHRUN or (prev == "-m" and _within(word, _OURS)):
            return True
        if word.endswith(_SCRIPT) and any(os.path.abspath(os.path.join(b, word)).startswith(_OUR_DIRS) for b in bases):
            return True
    return False


def _the_toolchains(cls, args, kw: dict, caller: str) -> bool:
    """Whose process it is. The test's, unless a toolchain package (_TOOLCHAIN, less torch's launchers) asked for it,
    as Triton's ldconfig and ptxas, inductor's compile workers and torch's C++ builds do; a launch of ours
    (`_launch_of_ours`) and a fork-server run (ForkedRun) are the test's whoever asks."""
    return (cls is subprocess.Popen and _within(caller, _TOOLCHAIN) and not _within(caller, _LAUNCHERS)
            and not _launch_of_ours(args, kw.get("cwd")))


def _no_processes(what: str):
    def refusing(cls, init):
        def guarded(self, args, *a, **kw):
            caller = _caller(sys._getframe(1))
            if _the_toolchains(cls, args, kw, caller):
                return init(self, args, *a, **kw)
            raise AssertionError(f"{what} started a process ({args!r}, called from {caller}): mark the test "
                                 f"@pytest.mark.{INTEGRATION} (tests/conftest.py)")
        return guarded
    return _starts([refusing(cls, init) for cls, init in _STARTS])


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
