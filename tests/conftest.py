"""Test-wide settings (no torch.compile, one BLAS thread per process, the repo on sys.path, the Triton
interpreter where there is no CUDA device) and the one shared teacher fixture.

TRITON_INTERPRET must be set before anything imports triton; it is set only without CUDA, so that on
a GPU the kernel tests run the compiled kernels (and the CUDA-only test runs). An explicit
TRITON_INTERPRET in the environment wins.
"""
import os
import sys

import pytest
import torch

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.utils import train_debug_teacher  # noqa: E402


@pytest.fixture(scope="session")
def debug_teacher(tmp_path_factory) -> str:
    """The DMD2 tests' teacher, trained once per session: `tests.utils.train_debug_teacher` (10 AdamW steps
    of the debug DiT on digits, micro-batch 8, lr 3e-3, seed 5; deterministic). Tests only read it."""
    return train_debug_teacher(str(tmp_path_factory.mktemp("debug_teacher") / "teacher"))
