"""The three quickstarts end to end at toy budgets (a few steps and samples each), as the README's first command
runs them on a fresh machine: into an empty RUN_DIR, each step's `--save D --load D` starting fresh, the runs and
samplers (side by side where the script runs them so), the tables and curves at the end (a re-run resuming them:
tests/test_guard_rails_checkpoints.py). The figures are not looked at (a few steps learn nothing): what is checked
is that every part ran and wrote what the next reads. The real budgets' tables are in docs/usage.md and
docs/causal.md."""
import json
import subprocess

import pytest

from tests.utils import REPO, child_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

TOY = {"TEACHER_ITERS": "3", "DMD2_ITERS_4STEP": "2", "DMD2_ITERS_1STEP": "2", "LORA_RANK": "2", "JOBS": "2"}


def quickstart(script: str, run_dir, **env) -> subprocess.CompletedProcess:
    # JOBS=2 on 2 "cores" (nproc reads OMP_NUM_THREADS): the digits and video scripts run two jobs at once
    full = child_env({**TOY, **env, "RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "2"})
    proc = subprocess.run(["bash", f"launch/{script}"], cwd=REPO, env=full, capture_output=True, text=True,
                          timeout=800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def rows(path) -> list:
    with open(path) as f:
        return list(json.load(f))  # {row name: its metrics}, in the table's order


def test_digits_quickstart_end_to_end(tmp_path):
    run = tmp_path / "run"
    first = quickstart("quickstart.sh", run, NUM_SAMPLES="20")
    names = rows(run / "metrics.json")
    assert names[:3] == ["teacher, 50 Euler steps, CFG 1.25", "teacher, 4 Euler steps, CFG 1.25",
                         "teacher, 1 Euler step, CFG 1.25"]
    assert "DMD2 student, 4 steps" in names and "DMD2 student, 1 step" in names
    assert "DMD2 LoRA student rank 2, 4 steps" in names
    assert (run / "curves.png").is_file() and (run / "metrics.md").is_file()
    assert "no checkpoint in --load" in first.stdout  # each run started fresh in its own empty folder


def test_video_quickstart_end_to_end(tmp_path):
    run = tmp_path / "run"
    quickstart("quickstart_video.sh", run, NUM_SAMPLES="40", I2V_TEACHER_ITERS="3", I2V_DMD2_ITERS="2")
    names = rows(run / "metrics.json")
    assert "DMD2 student, 4 steps" in names and "DMD2 student, 1 step" in names
    assert rows(run / "metrics_i2v.json") == ["I2V teacher, 50 Euler steps, CFG 2", "I2V teacher, 4 Euler steps, CFG 2",
                                              "I2V DMD2 student, 4 steps"]
    assert (run / "grid.gif").is_file() and (run / "grid_i2v.gif").is_file()


def test_causal_quickstart_end_to_end(tmp_path):
    run = tmp_path / "run"
    quickstart("quickstart_causal.sh", run, NUM_SAMPLES="40", PATHS="32", INIT_ITERS="2", DMD2_ITERS="2",
               SF_ITERS="2")
    tables = sorted(p.name for p in run.glob("metrics_*.json"))
    assert len(tables) == 2, tables  # at T and at 2T frames
    for name in tables:
        assert rows(run / name)[-2:] == ["causal init, 4 steps per chunk, streamed",
                                         "Self-Forcing student, 4 steps per chunk, streamed"]
