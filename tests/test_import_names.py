"""Our Triton kernels import as `dmd2_kernels`; the name `kernels` is Hugging Face's (issue 53).

transformers >= 5.25 requires Hugging Face's `kernels` package and imports it; when our kernels took that name, every
diffusers model import failed beside them. Checked in a fresh interpreter started in the repository root (its
directory first on sys.path, as `python -c` and a launch script run there have it) and in this process (pytest, the
repository root on sys.path too).
"""
import importlib.metadata
import os
import subprocess
import sys

import pytest

from tests.utils import REPO, child_env

pytestmark = pytest.mark.timeout(300)
OURS = os.path.join(REPO, "kernels") + os.sep  # the folder of our kernels (a venv may sit in the repository too)

PROBE = """
import sys
import kernels, transformers, diffusers
from diffusers import WanTransformer3DModel
import dmd2_mega, dmd2_kernels
print(kernels.__file__)
print(dmd2_kernels.__file__)
print(hasattr(kernels, "get_kernel"), hasattr(dmd2_kernels, "dmd_loss"))
"""


def hub_kernels_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.integration
def test_hub_kernels_and_ours_import_side_by_side_from_the_repository_root():
    if not hub_kernels_installed():  # transformers >= 5.25 requires it: only an older transformers lacks it
        pytest.skip("Hugging Face's `kernels` is not installed (transformers < 5.25)")
    res = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=child_env(), capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    hub, ours, attrs = res.stdout.split("\n")[-4:-1]
    assert not hub.startswith(OURS), f"`import kernels` found {hub}, not Hugging Face's package"
    assert ours == os.path.join(REPO, "kernels", "dmd2_kernels", "__init__.py")
    assert attrs == "True True"


def test_kernels_folder_takes_no_import_name():
    """kernels/ holds the dmd2_kernels package and is no package itself: nothing of ours answers `import kernels`."""
    assert not os.path.exists(os.path.join(REPO, "kernels", "__init__.py"))
    import dmd2_kernels
    assert os.path.dirname(dmd2_kernels.__file__) == os.path.join(REPO, "kernels", "dmd2_kernels")
    if hub_kernels_installed():
        import kernels
        assert getattr(kernels, "__file__", None) and not kernels.__file__.startswith(OURS)
        assert hasattr(kernels, "get_kernel")
