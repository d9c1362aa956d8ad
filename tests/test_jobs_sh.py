"""launch/jobs.sh, the quickstarts' runs side by side: JOBS at a time, each output line prefixed and logged, and a
failed run stopping the script with its name, status and log (the others killed)."""
import os
import re
import subprocess
import textwrap
import time

import pytest

pytestmark = pytest.mark.integration  # runs bash

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(tmp_path, body: str, **env):
    script = tmp_path / "s.sh"
    script.write_text(f"set -euo pipefail\nRUN_DIR={tmp_path}/run\nsource {ROOT}/launch/jobs.sh\n"
                      + textwrap.dedent(body))
    full = {**os.environ, **{k: str(v) for k, v in env.items()}}
    start = time.monotonic()
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=full, timeout=60)
    return proc, time.monotonic() - start


WAITER = """
    wait_for() {  # waits for file $1 (up to $3 tenths of a second, default 15 s), then prints $2
        for _ in $(seq "${3:-150}"); do [ -e "$1" ] && { echo "$2"; return 0; }; sleep 0.1; done
        echo "timed out waiting for $1"; return 7
    }
"""


def test_two_jobs_run_side_by_side_prefixed_and_logged(tmp_path):
    proc, _ = run_script(tmp_path, WAITER + f"""
        jobs_init
        job first wait_for {tmp_path}/flag "first saw the flag"
        job second bash -c "echo second line \\$OMP_NUM_THREADS; touch {tmp_path}/flag"
        jobs_wait
        echo all done
    """, JOBS=2, NPROC=1, OMP_NUM_THREADS=4)  # nproc counts OMP_NUM_THREADS: 4 "cores", 2 threads a job
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()
    # the first job waits for a flag the second makes: it would time out if they ran one after the other
    assert "[first] first saw the flag" in out and "[second] second line 2" in out
    assert any(line.startswith("[first] done in ") for line in out)
    assert out[0] == "> independent runs: 2 at once, 2 thread(s) each (4 cores; JOBS=1: one at a time)"
    assert out[-1] == "all done"
    assert (tmp_path / "run/logs/first.log").read_text() == "first saw the flag\n"
    assert (tmp_path / "run/logs/second.log").read_text() == "second line 2\n"


def test_one_job_at_a_time_runs_in_order_unprefixed(tmp_path):
    # one at a time: in the foreground, unprefixed, in order; a failing one stops the script with its own status
    proc, _ = run_script(tmp_path, WAITER + f"""
        jobs_init
        job first bash -c "echo one"
        job second bash -c "echo two"
        echo "threads $JOB_THREADS"
        job third wait_for {tmp_path}/never "unreachable" 5
    """, JOBS=1, NPROC=1, OMP_NUM_THREADS=6)
    assert proc.returncode == 7, proc.stdout + proc.stderr  # set -e: the foreground command's own status
    out = proc.stdout.splitlines()
    assert [re.sub(r"done in \d+s", "done", line) for line in out[:5]] == \
        ["one", "[first] done", "two", "[second] done", "threads 6"]
    assert out[-1] == f"timed out waiting for {tmp_path}/never"


def test_a_failed_job_stops_the_script_and_the_others(tmp_path):
    proc, took = run_script(tmp_path, f"""
        jobs_init
        job slow bash -c "sleep 40; touch {tmp_path}/slow_finished"
        job broken bash -c "echo boom; exit 3"
        jobs_wait
        echo unreachable
    """, JOBS=2, NPROC=1)
    assert proc.returncode == 1
    assert "unreachable" not in proc.stdout
    assert (f"error: run 'broken' failed (exit 3); the other runs were stopped. "
            f"Its log: {tmp_path}/run/logs/broken.log") in proc.stderr
    assert "boom" in proc.stderr.splitlines()[-1]
    assert took < 30  # the slow job was killed, not waited for
    time.sleep(0.5)
    assert not (tmp_path / "slow_finished").exists()


def test_a_stopped_job_runs_no_further_command_however_slow_the_killing(tmp_path):
    # CI once saw 'sleep 40; touch' touch: the leaves were killed before their parent shell, which ran its next
    # command in between. Slowing every kill down (a pause after each signal sent) makes that window wide; the tree
    # must be frozen before any of it is killed, so nothing runs in it
    proc, took = run_script(tmp_path, f"""
        kill() {{ builtin kill "$@"; local rc=$?; [ "$1" = -0 ] || sleep 0.3; return $rc; }}
        jobs_init
        job slow bash -c "sleep 40; touch {tmp_path}/slow_finished"
        job broken bash -c "sleep 1; exit 3"
        jobs_wait
    """, JOBS=2, NPROC=1)
    assert proc.returncode == 1 and took < 30
    assert "error: run 'broken' failed (exit 3)" in proc.stderr
    time.sleep(0.5)
    assert not (tmp_path / "slow_finished").exists()


def test_a_function_job_stops_at_its_failed_step(tmp_path):
    # a job that is a function (the quickstarts' distill: train, then sample) fails at its first failed step, as it
    # would in the foreground under set -e, and does not go on to the next step
    proc, _ = run_script(tmp_path, f"""
        train_then_sample() {{ bash -c "echo training; exit 4"; touch {tmp_path}/sampled; }}
        jobs_init
        job student train_then_sample
        jobs_wait
        echo unreachable
    """, JOBS=2, NPROC=1)
    assert proc.returncode == 1
    assert "error: run 'student' failed (exit 4)" in proc.stderr
    assert not (tmp_path / "sampled").exists()


def test_a_full_queue_waits_for_a_free_slot(tmp_path):
    # 3 jobs, 2 slots: the third starts only after one of the first two has ended
    proc, _ = run_script(tmp_path, WAITER + f"""
        jobs_init
        job a bash -c "sleep 1; touch {tmp_path}/a_done"
        job b bash -c "sleep 1; touch {tmp_path}/b_done"
        job c bash -c "if [ -e {tmp_path}/a_done ] || [ -e {tmp_path}/b_done ]; then echo after; else echo early; fi"
        jobs_wait
    """, JOBS=2, NPROC=1)
    assert proc.returncode == 0, proc.stderr
    assert "[c] after" in proc.stdout.splitlines()


@pytest.mark.parametrize("jobs", ["0", "two", "-1"])
def test_bad_jobs_value_is_a_clear_error(tmp_path, jobs):
    proc, _ = run_script(tmp_path, "jobs_init\necho unreachable\n", JOBS=jobs, NPROC=1)
    assert proc.returncode == 2
    assert f"error: JOBS must be a positive integer (runs at once), got '{jobs}'" in proc.stderr


def test_torchrun_runs_one_at_a_time(tmp_path):
    # NPROC > 1: each run is a torchrun over the cores already
    proc, _ = run_script(tmp_path, 'jobs_init\necho "jobs $JOBS"\n', JOBS=3, NPROC=2)
    assert proc.returncode == 0 and proc.stdout.strip() == "jobs 1"
