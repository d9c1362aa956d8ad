"""benchmarks/gpu_check.sh without CUDA (issue 49 item 4): a dry run that lists every step it would run, leaves its
three files (summary.tsv, figures.csv, logs.tar.gz) within what a device call brings back (at most 8 files, at most
two folders down, names of letters, digits, '.', '_' and '-'), prints the summary table last and exits 0. CUDA is
hidden from the script (tests/utils.child_env), so this is the dry run on a GPU machine too."""
import csv
import os
import re
import sys
import tarfile

import pytest

from tests.utils import run

FILES = {"summary.tsv", "figures.csv", "logs.tar.gz"}


@pytest.mark.integration
def test_gpu_check_dry_run_without_cuda(tmp_path):
    out = tmp_path / "out"
    res = run(["bash", "benchmarks/gpu_check.sh"], timeout=300,
              extra_env={"OUT": str(out), "PYTHON": sys.executable, "STEPS": "", "DRY_RUN": ""})
    res.check("gpu_check.sh's dry run")

    files = [os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs]
    assert set(files) == FILES, files
    assert len(files) <= 8 and all(len(f.split(os.sep)) <= 3 for f in files), files
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for f in files for part in f.split(os.sep)), files

    with open(out / "summary.tsv") as f:
        summary = [line.rstrip("\n").split("\t") for line in f]
    assert summary[0] == ["step", "rc", "seconds", "note"]
    steps = {r[0]: r for r in summary[1:]}
    assert {"env", "nvidia_smi", "suite", "bench_kernels", "cycle_bf16", "wan13b_cycle",
            "sit_xl2_cycle"} <= set(steps), list(steps)
    assert steps["env"][1] == "0", res.tail()  # the environment report runs: it says why there is no CUDA
    for name, row in steps.items():
        if name != "env":
            assert row[1:3] == ["skip", "0"] and row[3] == "needs CUDA", row
            assert re.search(rf"^=== {name} \(timeout \d+ s\) would run: \S", res.stdout, re.M), name

    # the summary table is printed last: after its heading, one line per row of summary.tsv, then nothing
    lines = res.stdout.rstrip("\n").split("\n")
    head = max(i for i, line in enumerate(lines) if line.startswith("=== summary"))
    table = lines[head + 1:]
    assert len(table) == len(summary), "\n".join(table)
    for printed, row in zip(table, summary):
        assert printed.split()[:2] == row[:2] and printed.endswith(row[3]), (printed, row)

    with open(out / "figures.csv", newline="") as f:
        figures = list(csv.reader(f))
    assert figures[0] == ["step", "name", "value"]
    assert {(r[0], r[1]) for r in figures[1:] if r[1] == "rc"} == {(name, "rc") for name in steps}
    assert ["env", "cuda available", "False"] in figures[1:]

    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
        env_log = tar.extractfile("gpu_check/env.log").read().decode()
    assert "gpu_check/env.log" in names and "gpu_check/summary.tsv" in names, names
    assert "torch:" in env_log and "cuda available: False" in env_log, env_log
