"""The import layers of `.importlinter` hold (kernels standalone, models below methods, the machinery methods
share (methods/ base, roles, rollout, ema, pair_checkpoint, trainer; train/) below every method, nothing in the
package imports launch/ or benchmarks/, no cycle between the modules of a package, the package's layers of
docs/architecture.md, only dmd2_mega.models imports a family's modules), checked by import-linter's `lint-imports`
on this checkout; and the contracts really fail on a violation."""
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lint(root: str) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    assert exe, "lint-imports is missing: pip install -e '.[test]' (import-linter)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((root, os.path.join(root, "kernels")))}  # dmd2_kernels
    return subprocess.run([exe, "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.integration
def test_import_contracts_hold():
    res = lint(REPO)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "7 kept, 0 broken" in res.stdout, res.stdout[-2000:]


@pytest.mark.integration
def test_contracts_catch_a_cycle_and_a_forbidden_import(tmp_path):
    """A copy of the tree with flow -> config (config imports flow: a cycle), dmd2_kernels -> dmd2_mega, models ->
    train (a layer importing one above it), the shared student trainer -> DMD2 (the slot naming a method) and
    pretrained -> a family's module (only models/ reaches into a family)."""
    root = tmp_path / "tree"
    for name in ("dmd2_mega", "kernels", "launch", "benchmarks"):
        shutil.copytree(os.path.join(REPO, name), root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(REPO, ".importlinter"), root / ".importlinter")
    for path, line in ((root / "dmd2_mega" / "flow.py", "from dmd2_mega import config  # noqa\n"),
                       (root / "kernels" / "dmd2_kernels" / "cfg.py", "import dmd2_mega.flow  # noqa\n"),
                       (root / "dmd2_mega" / "models" / "family.py", "from dmd2_mega.train import logger  # noqa\n"),
                       (root / "dmd2_mega" / "methods" / "trainer.py",
                        "from dmd2_mega.methods.dmd2 import phases  # noqa\n"),
                       (root / "dmd2_mega" / "pretrained.py", "from dmd2_mega.models.wan import model  # noqa\n")):
        path.write_text(path.read_text() + line)
    res = lint(str(root))
    assert res.returncode != 0
    assert "dmd2_kernels import nothing from dmd2_mega BROKEN" in res.stdout, res.stdout[-3000:]
    assert "no import cycles between the modules of a package BROKEN" in res.stdout, res.stdout[-3000:]
    assert "the package's layers of docs/architecture.md BROKEN" in res.stdout, res.stdout[-3000:]
    assert "dmd2_mega.models.family -> dmd2_mega.train.logger" in res.stdout, res.stdout[-3000:]
    assert "the machinery methods share imports no method BROKEN" in res.stdout, res.stdout[-3000:]
    assert "only dmd2_mega.models imports a family's modules BROKEN" in res.stdout, res.stdout[-3000:]
    assert "dmd2_mega.pretrained -> dmd2_mega.models.wan.model" in res.stdout, res.stdout[-3000:]
