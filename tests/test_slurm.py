"""The SLURM batch scripts (launch/slurm/*.sbatch) in their DRY_RUN=1 mode, without SLURM installed.

The printed per-node torchrun command is parsed by torchrun's OWN argument parser
(torch.distributed.run.get_args_parser) and its script flags by the project's parsers, so a
misspelled flag, a wrong node count or a bad rendezvous address fails here. The srun line's per-node
`bash -c` is executed with a fake torchrun that records its argv, as each node's task would run it.
"""
from __future__ import annotations

import os
import shlex
import subprocess

import pytest
from torch.distributed.run import get_args_parser

from dmd2_mega.arguments import parse_dmd2_args, parse_flow_args
from tests.utils import REPO

pytestmark = pytest.mark.timeout(60)
SCRIPTS = {"flow": ("launch/slurm/pretrain_flow.sbatch", "launch/pretrain_flow.py", parse_flow_args),
           "dmd2": ("launch/slurm/pretrain_dmd2.sbatch", "launch/pretrain_dmd2.py", parse_dmd2_args)}


def run_script(path: str, env: dict, extra_path: str = "") -> subprocess.CompletedProcess:
    search = os.pathsep.join(p for p in (extra_path, "/usr/bin", "/bin") if p)
    base = {"PATH": search, "HOME": os.environ.get("HOME", "/")}
    return subprocess.run(["bash", os.path.join(REPO, path)], cwd=REPO, env={**base, **env}, text=True,
                          capture_output=True, timeout=30)


def node_commands(out: str) -> list:
    lines = out.splitlines()
    return [shlex.split(lines[i + 1]) for i, line in enumerate(lines) if line.startswith("# node ")]


def srun_command(out: str) -> list:
    lines = out.splitlines()
    return shlex.split(lines[lines.index("# srun:") + 1])


FAKE_ALLOC = {"DRY_RUN": "1", "SLURM_NNODES": "3", "SLURM_JOB_NODELIST": "gpu-a[07-09]", "SLURM_JOB_ID": "4242",
              "GPUS_PER_NODE": "4", "TP": "4", "MODEL_SIZE": "2b", "MICRO_BATCH_SIZE": "6",
              "TEACHER_LOAD": "/ckpt/teach", "SAVE": "/runs/a b/student", "EXTRA_ARGS": "--seed 7 --log-interval 5",
              "SLURM_CPUS_PER_TASK": "48"}


@pytest.mark.parametrize("kind", sorted(SCRIPTS))
def test_dry_run_prints_a_valid_torchrun_command_per_node(kind):
    script, entry, parse = SCRIPTS[kind]
    res = run_script(script, FAKE_ALLOC)
    assert res.returncode == 0, res.stderr
    cmds = node_commands(res.stdout)
    assert len(cmds) == 3
    for rank, cmd in enumerate(cmds):
        assert cmd[0] == "torchrun"
        a = get_args_parser().parse_args(cmd[1:])
        assert (a.nnodes, a.nproc_per_node, a.node_rank, a.master_addr) == ("3", "4", rank, "gpu-a07")
        assert a.master_port == 20000 + 4242 and a.training_script == entry
        cfg = parse(a.training_script_args)  # every flag exists and validates
        assert (cfg.model.size, cfg.parallel.tensor_model_parallel_size, cfg.train.micro_batch_size) == ("2b", 4, 6)
        assert cfg.optim.bf16 and cfg.train.seed == 7 and cfg.train.log_interval == 5
        assert cfg.train.save == cfg.train.load == "/runs/a b/student"  # a path with a space survives quoting
        assert cfg.train.global_batch_size is None  # unset: micro x DP, valid at any node count
        if kind == "dmd2":
            assert cfg.dmd2.teacher_load == "/ckpt/teach" and cfg.dmd2.offload_inactive is True
            assert cfg.dmd2.critic_steps_per_rollout == 5 and cfg.dmd2.denoising_steps == 4


@pytest.mark.parametrize("kind", sorted(SCRIPTS))
def test_srun_runs_torchrun_with_each_nodes_rank(kind, tmp_path):
    script, entry, _ = SCRIPTS[kind]
    log = tmp_path / "argv.txt"
    fake = tmp_path / "torchrun"
    fake.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {shlex.quote(str(log))}\n')
    fake.chmod(0o755)
    res = run_script(script, {**FAKE_ALLOC, "TORCHRUN": str(fake)})
    assert res.returncode == 0, res.stderr
    srun = srun_command(res.stdout)
    assert srun[:6] == ["srun", "--nodes", "3", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    assert srun[srun.index("--chdir") + 1] == REPO
    assert srun[srun.index("--cpus-per-task") + 1] == "48"  # SLURM >= 22.05 does not pass it on by itself
    task = srun[srun.index("bash"):]  # what srun starts on every node
    subprocess.run(task, env={"SLURM_NODEID": "2", "PATH": "/usr/bin:/bin"}, check=True, timeout=30)
    argv = log.read_text().splitlines()
    assert argv[:2] == ["--node-rank", "2"] and "/runs/a b/student" in argv
    a = get_args_parser().parse_args(argv)
    assert (a.node_rank, a.nnodes, a.master_addr, a.training_script) == (2, "3", "gpu-a07", entry)
    printed = node_commands(res.stdout)[2]
    assert argv[argv.index(entry):] == printed[printed.index(entry):]  # the same script flags, quoting intact


@pytest.mark.parametrize("nodelist,first", [("gpu-a[07-09]", "gpu-a07"), ("n1,n2", "n1"), ("gpu[3,5-6]", "gpu3"),
                                            ("a[01-02],b[1-2]", "a01"), ("single", "single")])
def test_master_addr_from_node_list_without_scontrol(nodelist, first):
    res = run_script(SCRIPTS["flow"][0], {"DRY_RUN": "1", "SLURM_JOB_NODELIST": nodelist})
    assert res.returncode == 0, res.stderr
    assert {get_args_parser().parse_args(c[1:]).master_addr for c in node_commands(res.stdout)} == {first}


def test_master_addr_from_scontrol_when_installed(tmp_path):
    fake = tmp_path / "scontrol"
    # a long list: a `| head -n1` pipe would die of SIGPIPE under pipefail
    fake.write_text('#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && echo head-node-x && seq -f "node%g" 1 50000\n')
    fake.chmod(0o755)
    res = run_script(SCRIPTS["dmd2"][0], {"DRY_RUN": "1", "SLURM_JOB_NODELIST": "whatever[1-2]"}, str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "MASTER_ADDR=head-node-x " in res.stdout


def test_dry_run_defaults_without_any_slurm_variables():
    res = run_script(SCRIPTS["dmd2"][0], {"DRY_RUN": "1"})
    assert res.returncode == 0, res.stderr
    cmds = node_commands(res.stdout)
    a = get_args_parser().parse_args(cmds[0][1:])
    assert (len(cmds), a.nnodes, a.nproc_per_node, a.master_addr) == (2, "2", "8", "node001")


@pytest.mark.parametrize("kind", sorted(SCRIPTS))
def test_outside_an_allocation_refuses_to_launch(kind):
    res = run_script(SCRIPTS[kind][0], {})
    assert res.returncode == 2
    assert "not inside a SLURM allocation" in res.stderr and "DRY_RUN=1" in res.stderr
    assert "torchrun" not in res.stdout
