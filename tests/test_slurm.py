"""The SLURM batch scripts (launch/slurm/*.sbatch) in their DRY_RUN=1 mode, without SLURM installed.

The printed per-node torchrun command is parsed by torchrun's OWN argument parser
(torch.distributed.run.get_args_parser) and its script flags by the project's parsers, so a
misspelled flag, a wrong node count or a bad rendezvous address fails here. The srun line's per-node
`bash -c` is executed with a fake torchrun that records its argv, as each node's task would run it.
The Wan 2.1 recipes take their layout from launch/plan_memory.py --search --emit-flags at job start: a fake
planner checks what it is asked and that its flags (and only they) set the layout; the real one, that its line
reaches every node; a failing planner stops the job with exit 3 before anything is launched.
The SiT-XL/2 ImageNet 256 recipe has a fixed layout (TP from the environment, DP over every GPU): each node's
command carries DMD2's ImageNet settings for a 1- or a 4-step student (STUDENT_STEPS), against a teacher folder
holding the config.json a converted SiT-XL-2-256x256.pt has.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
from torch.distributed.run import get_args_parser

from dmd2_mega.arguments import parse_dmd2_args, parse_flow_args
from tests.utils import REPO

pytestmark = [pytest.mark.timeout(60), pytest.mark.integration]  # every test runs a batch script
SCRIPTS = {"flow": ("launch/slurm/pretrain_flow.sbatch", "launch/pretrain_flow.py", parse_flow_args),
           "dmd2": ("launch/slurm/pretrain_dmd2.sbatch", "launch/pretrain_dmd2.py", parse_dmd2_args)}


def run_script(path: str, env: dict, extra_path: str = "", timeout: float = 30) -> subprocess.CompletedProcess:
    search = os.pathsep.join(p for p in (extra_path, "/usr/bin", "/bin") if p)
    base = {"PATH": search, "HOME": os.environ.get("HOME", "/")}
    return subprocess.run(["bash", os.path.join(REPO, path)], cwd=REPO, env={**base, **env}, text=True,
                          capture_output=True, timeout=timeout)


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


# ---- the Wan 2.1 recipes: their layout is launch/plan_memory.py's choice, made when the job starts -----------

WAN = {"14b": ("launch/slurm/dmd2_wan2.1_14b.sbatch", "wan2.1-14b", 8),  # script, planner's model, nodes
       "1.3b": ("launch/slurm/dmd2_wan2.1_1.3b.sbatch", "wan2.1-1.3b", 1)}
PLANNER = os.path.join(REPO, "launch", "plan_memory.py")
LAYOUT = ["--tensor-model-parallel-size", "4", "--context-parallel-size", "2", "--sequence-parallel",
          "--use-distributed-optimizer", "--recompute-granularity", "full", "--offload-inactive"]


def fake_python(tmp_path, flags: str = " ".join(LAYOUT), table: str = "FAKE PLAN TABLE", rc: int = 0) -> str:
    """A stand-in for the `python` that runs launch/plan_memory.py: appends its argv to calls.txt, prints `flags`
    for --emit-flags and `table` otherwise, then exits `rc` (with a ConfigError line on stderr when rc != 0)."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/bash
printf '%s\\n' "$*" >> {shlex.quote(str(tmp_path / "calls.txt"))}
[[ {rc} != 0 ]] && {{ echo "ConfigError: no layout fits" >&2; exit {rc}; }}
for a in "$@"; do [[ "$a" == --emit-flags ]] && {{ printf '%s\\n' {shlex.quote(flags)}; exit 0; }}; done
printf '%s\\n' {shlex.quote(table)}
""")
    fake.chmod(0o755)
    return str(fake)


def wan_teacher(tmp_path, model: str) -> str:
    """A converted teacher as the trainer's flag parser sees it: a folder with the size's diffusers config.json."""
    from dmd2_mega.models import get_spec
    d = tmp_path / "wan teacher"  # a space: the path must survive the quoting
    d.mkdir()
    (d / "config.json").write_text(json.dumps(get_spec(model).diffusers_config()))
    return str(d)


def wan_env(kind: str, tmp_path, python: str, **extra) -> dict:
    return {"DRY_RUN": "1", "TEACHER": wan_teacher(tmp_path, WAN[kind][1]), "DATA_PATH": "/data/wan shards",
            "SAVE": "/runs/wan student", "PYTHON": python, **extra}


def option(argv: list, flag: str, n: int = 1) -> list:
    i = argv.index(flag)
    return argv[i + 1:i + 1 + n]


def contains_run(seq: list, part: list) -> bool:
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


@pytest.mark.parametrize("kind", sorted(WAN))
def test_wan_dry_run_plans_the_layout_and_prints_a_valid_torchrun_command_per_node(kind, tmp_path):
    script, model, nodes = WAN[kind]
    env = wan_env(kind, tmp_path, fake_python(tmp_path))
    res = run_script(script, env)
    assert res.returncode == 0, res.stderr
    assert "FAKE PLAN TABLE" in res.stdout  # the planner's table is in the job log
    table_call, flags_call = [shlex.split(c) for c in (tmp_path / "calls.txt").read_text().splitlines()]
    assert table_call[0] == PLANNER and flags_call == table_call + ["--emit-flags"]
    want = {"--model-size": [model], "--latent-shape": ["16", "21", "60", "104"], "--text-len": ["512"],
            "--micro-batch-size": ["1"], "--dmd2-critic-steps-per-rollout": ["5"], "--dmd2-denoising-steps": ["4"],
            "--dmd2-teacher-guidance-scale": ["5"], "--gpu-memory-gb": ["80"], "--world-size": [str(8 * nodes)],
            "--gpus-per-node": ["8"]}
    assert {f: option(table_call, f, len(v)) for f, v in want.items()} == want
    assert "--search" in table_call and "--bf16" in table_call
    cmds = node_commands(res.stdout)
    assert len(cmds) == nodes
    for rank, cmd in enumerate(cmds):
        a = get_args_parser().parse_args(cmd[1:])
        assert (a.nnodes, a.nproc_per_node, a.node_rank, a.master_addr) == (str(nodes), "8", rank, "node001")
        assert a.training_script == "launch/pretrain_dmd2.py"
        assert contains_run(a.training_script_args, LAYOUT)  # the planner's flags, as it printed them
        cfg = parse_dmd2_args(a.training_script_args)  # every flag exists and validates
        p = cfg.parallel
        assert (p.tensor_model_parallel_size, p.context_parallel_size, p.sequence_parallel) == (4, 2, True)
        assert cfg.optim.use_distributed_optimizer and cfg.model.recompute_granularity == "full"
        assert cfg.model.size == cfg.dmd2.teacher_load == env["TEACHER"]  # a converted folder is a size
        assert cfg.dmd2.student_load is None and cfg.dmd2.critic_load is None  # both start from the teacher
        assert cfg.optim.bf16 and cfg.ema.decay == 0.99 and cfg.dmd2.offload_inactive is True
        assert (cfg.dmd2.denoising_steps, cfg.dmd2.critic_steps_per_rollout, cfg.dmd2.teacher_guidance_scale) == \
            (4, 5, 5.0)
        assert cfg.train.timestep_shift == 3.0 and cfg.train.micro_batch_size == 1
        assert cfg.train.data == "/data/wan shards" and cfg.train.save == cfg.train.load == "/runs/wan student"
        assert cfg.train.global_batch_size is None and cfg.train.save_interval >= 1
        assert cfg.train.eval_interval is None and cfg.train.vae is None  # no VAE, no eval


@pytest.mark.parametrize("vae,prompts", [("/m/Wan2.1 VAE", None), ("/m/vae", "/p/eval prompts.safetensors"),
                                         (None, "/p/prompts.safetensors")])
def test_wan_eval_flags_follow_vae_and_eval_prompts(vae, prompts, tmp_path):
    extra = {k: v for k, v in (("VAE", vae), ("EVAL_PROMPTS", prompts)) if v}
    res = run_script(WAN["1.3b"][0], wan_env("1.3b", tmp_path, fake_python(tmp_path), **extra))
    assert res.returncode == 0, res.stderr
    cfg = parse_dmd2_args(get_args_parser().parse_args(node_commands(res.stdout)[0][1:]).training_script_args)
    assert (cfg.train.vae, cfg.train.eval_prompts) == (vae, prompts)
    assert cfg.train.eval_interval == 500 and cfg.train.eval_num_samples == 16


def test_wan_planner_inputs_follow_the_allocation_and_the_knobs(tmp_path):
    env = wan_env("14b", tmp_path, fake_python(tmp_path), LATENT_SHAPE="16 21 90 160", TEXT_LEN="256",
                  PLAN_MODEL="wan2.1-1.3b", GPU_MEMORY_GB="141", SLURM_NNODES="3",
                  SLURM_JOB_NODELIST="gpu[4-6]", GPUS_PER_NODE="4", GUIDANCE="3.5", CRITIC_STEPS="2")
    res = run_script(WAN["14b"][0], env)
    assert res.returncode == 0, res.stderr
    call = shlex.split((tmp_path / "calls.txt").read_text().splitlines()[0])
    assert option(call, "--latent-shape", 4) == ["16", "21", "90", "160"] and option(call, "--text-len") == ["256"]
    assert option(call, "--model-size") == ["wan2.1-1.3b"] and option(call, "--gpu-memory-gb") == ["141"]
    assert option(call, "--world-size") == ["12"] and option(call, "--gpus-per-node") == ["4"]
    assert option(call, "--dmd2-teacher-guidance-scale") == ["3.5"]
    assert option(call, "--dmd2-critic-steps-per-rollout") == ["2"]
    cmds = node_commands(res.stdout)
    a = get_args_parser().parse_args(cmds[2][1:])
    assert (len(cmds), a.nnodes, a.nproc_per_node, a.node_rank, a.master_addr) == (3, "3", "4", 2, "gpu4")
    cfg = parse_dmd2_args(a.training_script_args)  # the trainer gets the values the planner was given
    assert cfg.dmd2.teacher_guidance_scale == 3.5 and cfg.dmd2.critic_steps_per_rollout == 2


@pytest.mark.parametrize("offload,asleep", [("--offload-inactive", ("student", "critic", "teacher")),
                                            ("--no-offload-inactive", ()),
                                            ("--offload-roles critic,student", ("critic", "student"))])
def test_wan_time_slicing_is_the_planners_choice(offload, asleep, tmp_path):
    flags = f"--tensor-model-parallel-size 2 --context-parallel-size 1 --use-distributed-optimizer {offload}"
    res = run_script(WAN["1.3b"][0], wan_env("1.3b", tmp_path, fake_python(tmp_path, flags=flags)))
    assert res.returncode == 0, res.stderr
    args = get_args_parser().parse_args(node_commands(res.stdout)[0][1:]).training_script_args
    cfg = parse_dmd2_args(args)  # no later flag of the script overrides the plan
    assert cfg.dmd2.offload_set(("student", "critic", "teacher")) == frozenset(asleep)
    assert cfg.parallel.tensor_model_parallel_size == 2 and not cfg.parallel.sequence_parallel
    assert cfg.model.recompute_granularity is None


@pytest.mark.parametrize("kind", sorted(WAN))
@pytest.mark.parametrize("how", ["fails", "prints nothing", "prints two lines"])
def test_wan_planner_failure_stops_the_job_with_a_clear_error(kind, how, tmp_path):
    python = {"fails": lambda: fake_python(tmp_path, rc=1),
              "prints nothing": lambda: fake_python(tmp_path, flags=""),
              "prints two lines": lambda: fake_python(tmp_path, flags="--sequence-parallel\n--offload-inactive")}[how]()
    res = run_script(WAN[kind][0], wan_env(kind, tmp_path, python))
    assert res.returncode == 3, (res.returncode, res.stderr)
    assert "launch/plan_memory.py" in res.stderr and "error:" in res.stderr
    assert "torchrun" not in res.stdout and "# node " not in res.stdout and "# srun:" not in res.stdout
    if how == "fails":
        assert "ConfigError: no layout fits" in res.stderr  # the planner's own line reaches the log


@pytest.mark.parametrize("kind", sorted(WAN))
def test_wan_planner_missing_is_a_clear_error(kind, tmp_path):
    res = run_script(WAN[kind][0], wan_env(kind, tmp_path, str(tmp_path / "no-such-python")))
    assert res.returncode == 3 and "launch/plan_memory.py failed (exit 127)" in res.stderr, res.stderr
    assert "torchrun" not in res.stdout


@pytest.mark.parametrize("missing", ["TEACHER", "DATA_PATH"])
def test_wan_needs_teacher_and_data(missing, tmp_path):
    env = wan_env("14b", tmp_path, fake_python(tmp_path))
    del env[missing]
    res = run_script(WAN["14b"][0], env)
    assert res.returncode == 2 and f"error: set {missing}" in res.stderr, res.stderr
    assert not (tmp_path / "calls.txt").exists()  # nothing planned, nothing printed
    assert "torchrun" not in res.stdout


@pytest.mark.parametrize("kind", sorted(WAN))
def test_wan_outside_an_allocation_refuses_to_launch(kind, tmp_path):
    env = wan_env(kind, tmp_path, fake_python(tmp_path))
    del env["DRY_RUN"]
    res = run_script(WAN[kind][0], env)
    assert res.returncode == 2 and "not inside a SLURM allocation" in res.stderr
    assert not (tmp_path / "calls.txt").exists() and "torchrun" not in res.stdout


def test_wan_srun_runs_torchrun_with_the_planned_layout(tmp_path):
    log = tmp_path / "argv.txt"
    fake = tmp_path / "torchrun"
    fake.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {shlex.quote(str(log))}\n')
    fake.chmod(0o755)
    res = run_script(WAN["14b"][0], wan_env("14b", tmp_path, fake_python(tmp_path), TORCHRUN=str(fake)))
    assert res.returncode == 0, res.stderr
    srun = srun_command(res.stdout)
    assert srun[:6] == ["srun", "--nodes", "8", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    subprocess.run(srun[srun.index("bash"):], env={"SLURM_NODEID": "5", "PATH": "/usr/bin:/bin"}, check=True,
                   timeout=30)
    argv = log.read_text().splitlines()
    assert argv[:2] == ["--node-rank", "5"] and contains_run(argv, LAYOUT)
    printed = node_commands(res.stdout)[5]
    assert argv[argv.index("launch/pretrain_dmd2.py"):] == printed[printed.index("launch/pretrain_dmd2.py"):]


# The real planner: its --search --emit-flags line is what every node runs (each planner call imports torch, so one
# script is enough here; the fake planner above covers the rest).
@pytest.mark.timeout(300)
def test_wan_dry_run_with_the_real_planner(tmp_path):
    script, model, nodes = WAN["14b"]
    res = run_script(script, wan_env("14b", tmp_path, sys.executable), timeout=240)
    assert res.returncode == 0, res.stderr
    out = res.stdout.splitlines()
    start = out.index("# memory plan (launch/plan_memory.py --search):")
    end = next(i for i, line in enumerate(out) if line.startswith("# layout: "))
    flags = shlex.split(out[end][len("# layout: "):])
    assert len(out[start + 1:end]) > 3 and "chosen: TP=" in res.stdout, res.stdout  # the table, in the log
    assert flags[:2] == ["--tensor-model-parallel-size", "2"] and "--sequence-parallel" in flags  # docs/performance.md
    for cmd in node_commands(res.stdout):
        a = get_args_parser().parse_args(cmd[1:])
        assert contains_run(a.training_script_args, flags)
        cfg = parse_dmd2_args(a.training_script_args)
        tp_cp = cfg.parallel.tensor_model_parallel_size * cfg.parallel.context_parallel_size
        assert (8 * nodes) % tp_cp == 0 and 40 % tp_cp == 0  # ranks and heads


# ---- the SiT-XL/2 ImageNet 256 recipe: a fixed layout (TP, DP over every GPU) and DMD2's ImageNet settings --------

SIT = "launch/slurm/dmd2_sit_xl2_imagenet256.sbatch"


def sit_teacher(tmp_path) -> str:
    """A SiT-XL/2 teacher as the trainer's flag parser sees it: the config.json that `convert_checkpoint.py
    --from-official SiT-XL-2-256x256.pt --parameterization sit` writes, from the official file's shapes (meta
    tensors: no weights) and a folder name with a space, which must survive the quoting."""
    import torch

    from dmd2_mega.models.dit.checkpoints import official_spec, our_config
    h, layers, p, c, classes = 1152, 28, 2, 4, 1000
    shapes = {"x_embedder.proj.weight": (h, c, p, p), "pos_embed": (1, 256, h), "t_embedder.mlp.0.weight": (h, 256),
              "y_embedder.embedding_table.weight": (classes + 1, h), "final_layer.linear.weight": (p * p * 2 * c, h),
              **{f"blocks.{i}.mlp.fc1.weight": (4 * h, h) for i in range(layers)}}
    d = tmp_path / "sit teacher"
    d.mkdir()
    spec = official_spec({k: torch.empty(s, device="meta") for k, s in shapes.items()}, str(d), "sit")
    (d / "config.json").write_text(json.dumps(our_config(spec)))
    return str(d)


def sit_env(tmp_path, **extra) -> dict:
    return {"DRY_RUN": "1", "TEACHER": sit_teacher(tmp_path), "DATA_PATH": "/data/in 256", **extra}


def script_cfg(cmd: list):
    """(torchrun's parse of one node's command, the trainer's validated config of its script flags)."""
    a = get_args_parser().parse_args(cmd[1:])
    return a, parse_dmd2_args(a.training_script_args)


@pytest.mark.parametrize("steps", ["1", "4"])
def test_sit_dry_run_prints_the_dmd2_imagenet_recipe_per_node(steps, tmp_path):
    from dmd2_mega.plan import memory_plan as mp
    env = sit_env(tmp_path, STUDENT_STEPS=steps)
    teacher = env["TEACHER"]
    counts = mp.param_counts(mp.model_shape(teacher, 4, 32, num_classes=1000))
    assert round((counts["sharded"] + counts["replicated"]) / 1e6) == 675  # the fixture is SiT-XL/2's size
    res = run_script(SIT, env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("# MASTER_ADDR=node001 MASTER_PORT=20000 nodes=4 gpus/node=8\n")
    cmds = node_commands(res.stdout)
    assert len(cmds) == 4  # the #SBATCH allocation: 4 nodes x 8 GPUs
    run = f"sit_xl2_dmd2_{steps}step"  # the 1- and 4-step runs save (and resume) apart
    for rank, cmd in enumerate(cmds):
        assert cmd[0] == "torchrun"
        a, cfg = script_cfg(cmd)
        assert (a.nnodes, a.nproc_per_node, a.node_rank, a.master_addr, a.master_port) == ("4", "8", rank, "node001",
                                                                                            20000)
        assert a.training_script == "launch/pretrain_dmd2.py"
        assert cfg.model.size == cfg.dmd2.teacher_load == teacher  # a converted folder is a size
        assert cfg.dmd2.student_load is None and cfg.dmd2.critic_load is None  # both start from the teacher
        assert cfg.parallel.tensor_model_parallel_size == 1 and cfg.parallel.context_parallel_size == 1
        assert not cfg.optim.use_distributed_optimizer and cfg.model.recompute_granularity is None
        d = cfg.dmd2
        assert (d.denoising_steps, d.critic_steps_per_rollout, d.teacher_guidance_scale) == (int(steps), 5, 1.5)
        assert d.offload_inactive is None  # the trainer's memory plan decides what sleeps
        assert (cfg.optim.lr, cfg.critic_optim().lr, cfg.optim.lr_decay_style) == (2e-6, 2e-6, "constant")
        assert (cfg.optim.weight_decay, cfg.optim.clip_grad) == (0.01, 10.0)
        assert cfg.gan.enabled and (cfg.gan.gen_weight, cfg.gan.disc_weight) == (3e-3, 1e-2)
        assert cfg.ema.enabled and cfg.ema.decay == 0.999 and not cfg.ema.no_ema
        assert cfg.optim.bf16 and cfg.train.timestep_shift == 1.0
        assert cfg.train.data == "/data/in 256" and cfg.train.micro_batch_size == 8
        assert cfg.train.global_batch_size is None  # micro x DP: 8 x 32 = 256
        assert cfg.train.save == cfg.train.load == f"ckpt/{run}" and cfg.train.tensorboard_dir == f"tb/{run}"
        assert cfg.train.save_interval == 1000 and cfg.train.train_iters == 200000
        assert cfg.train.eval_interval is None and cfg.train.vae is None  # no VAE, no eval


def test_sit_defaults_to_a_4_step_student(tmp_path):
    res = run_script(SIT, sit_env(tmp_path))
    assert res.returncode == 0, res.stderr
    _, cfg = script_cfg(node_commands(res.stdout)[0])
    assert cfg.dmd2.denoising_steps == 4 and cfg.train.save == "ckpt/sit_xl2_dmd2_4step"


def test_sit_vae_turns_on_the_eval(tmp_path):
    res = run_script(SIT, sit_env(tmp_path, VAE="/models/sd vae ft ema"))
    assert res.returncode == 0, res.stderr
    for cmd in node_commands(res.stdout):
        _, cfg = script_cfg(cmd)
        assert (cfg.train.vae, cfg.train.eval_interval, cfg.train.eval_num_samples) == ("/models/sd vae ft ema",
                                                                                        1000, 64)
        assert cfg.train.eval_prompts is None  # class labels: the eval samples classes 0, 1, 2, ...


def test_sit_knobs_reach_every_node(tmp_path):
    env = sit_env(tmp_path, TP="2", SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu[4-5]", SLURM_JOB_ID="77",
                  GPUS_PER_NODE="4", MICRO_BATCH_SIZE="16", GLOBAL_BATCH_SIZE="256", SAVE="/runs/sit a",
                  GUIDANCE="1.25", CRITIC_STEPS="3", LR="1e-6", CRITIC_LR="4e-6", EMA_DECAY="0.99",
                  EXTRA_ARGS="--dmd2-gan-gen-weight 1e-2 --seed 3")
    res = run_script(SIT, env)
    assert res.returncode == 0, res.stderr
    cmds = node_commands(res.stdout)
    assert len(cmds) == 2
    for rank, cmd in enumerate(cmds):
        a, cfg = script_cfg(cmd)
        assert (a.nnodes, a.nproc_per_node, a.node_rank, a.master_addr, a.master_port) == ("2", "4", rank, "gpu4",
                                                                                            20077)
        assert cfg.parallel.tensor_model_parallel_size == 2
        assert (cfg.train.micro_batch_size, cfg.train.global_batch_size) == (16, 256)
        assert cfg.train.save == cfg.train.load == "/runs/sit a"  # SAVE does not move the TensorBoard default
        assert cfg.train.tensorboard_dir == "tb/sit_xl2_dmd2_4step"
        assert (cfg.dmd2.teacher_guidance_scale, cfg.dmd2.critic_steps_per_rollout) == (1.25, 3)
        assert (cfg.optim.lr, cfg.critic_optim().lr, cfg.ema.decay) == (1e-6, 4e-6, 0.99)
        assert cfg.gan.gen_weight == 1e-2 and cfg.train.seed == 3  # EXTRA_ARGS come last, so they win


def test_sit_srun_runs_torchrun_with_each_nodes_rank(tmp_path):
    log = tmp_path / "argv.txt"
    fake = tmp_path / "torchrun"
    fake.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {shlex.quote(str(log))}\n')
    fake.chmod(0o755)
    res = run_script(SIT, sit_env(tmp_path, TORCHRUN=str(fake), SLURM_CPUS_PER_TASK="64"))
    assert res.returncode == 0, res.stderr
    srun = srun_command(res.stdout)
    assert srun[:6] == ["srun", "--nodes", "4", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    assert srun[srun.index("--cpus-per-task") + 1] == "64" and srun[srun.index("--chdir") + 1] == REPO
    subprocess.run(srun[srun.index("bash"):], env={"SLURM_NODEID": "3", "PATH": "/usr/bin:/bin"}, check=True,
                   timeout=30)
    argv = log.read_text().splitlines()
    assert argv[:2] == ["--node-rank", "3"]
    printed = node_commands(res.stdout)[3]
    entry = "launch/pretrain_dmd2.py"
    assert argv[argv.index(entry):] == printed[printed.index(entry):]  # the same script flags, quoting intact


@pytest.mark.parametrize("missing", ["TEACHER", "DATA_PATH"])
def test_sit_needs_teacher_and_data(missing, tmp_path):
    env = sit_env(tmp_path)
    del env[missing]
    res = run_script(SIT, env)
    assert res.returncode == 2 and f"error: set {missing} (the header of {SIT}" in res.stderr, res.stderr
    assert "torchrun" not in res.stdout and "# node " not in res.stdout


@pytest.mark.parametrize("steps", ["2", "four", ""])
def test_sit_student_steps_is_1_or_4(steps, tmp_path):
    res = run_script(SIT, sit_env(tmp_path, STUDENT_STEPS=steps))
    if steps == "":  # set but empty: the default
        assert res.returncode == 0, res.stderr
        return
    assert res.returncode == 2 and "error: STUDENT_STEPS must be 1 or 4" in res.stderr, res.stderr
    assert f"got '{steps}'" in res.stderr and "torchrun" not in res.stdout


def test_sit_outside_an_allocation_refuses_to_launch(tmp_path):
    env = sit_env(tmp_path)
    del env["DRY_RUN"]
    res = run_script(SIT, env)
    assert res.returncode == 2 and "not inside a SLURM allocation" in res.stderr and "DRY_RUN=1" in res.stderr
    assert "torchrun" not in res.stdout


# ---- the Self-Forcing recipe: the Wan body with a causal student and Self-Forcing's settings ------------------

SELF_FORCING = "launch/slurm/self_forcing_wan2.1_1.3b.sbatch"


def test_self_forcing_dry_run_plans_the_causal_student_with_self_forcings_settings(tmp_path):
    env = wan_env("1.3b", tmp_path, fake_python(tmp_path), STUDENT_LOAD="/ckpt/causal init", GRAD_CHUNKS="7")
    res = run_script(SELF_FORCING, env)
    assert res.returncode == 0, res.stderr
    table_call = shlex.split((tmp_path / "calls.txt").read_text().splitlines()[0])
    assert contains_run(table_call, ["--causal", "--causal-chunk-frames", "3"])  # the planner sizes the KV cache
    assert option(table_call, "--dmd2-student-sigmas", 4) == ["1", "0.75", "0.5", "0.25"]
    assert "--dmd2-denoising-steps" not in table_call and option(table_call, "--dmd2-teacher-guidance-scale") == ["3"]
    (cmd,) = node_commands(res.stdout)
    a = get_args_parser().parse_args(cmd[1:])
    assert a.training_script == "launch/pretrain_dmd2.py" and contains_run(a.training_script_args, LAYOUT)
    cfg = parse_dmd2_args(a.training_script_args)
    d, o = cfg.dmd2, cfg.optim
    assert (d.distill_method, d.causal_grad_chunks, d.student_load) == ("self-forcing", 7, "/ckpt/causal init")
    assert cfg.model.causal and cfg.model.causal_chunk_frames == 3 and cfg.model.causal_context_noise == 0.0
    assert d.student_sigmas == [1.0, 0.75, 0.5, 0.25] and d.denoising_steps == 4 and d.critic_steps_per_rollout == 5
    assert cfg.train.timestep_shift == 5.0 and d.teacher_guidance_scale == 3.0 and cfg.ema.decay == 0.99
    assert (o.lr, o.adam_beta1, o.adam_beta2) == (2e-6, 0.0, 0.999)
    assert (d.critic_lr, d.critic_adam_beta1, d.critic_adam_beta2) == (4e-7, 0.0, 0.999)


def test_self_forcing_recipe_needs_the_causal_init(tmp_path):
    res = run_script(SELF_FORCING, wan_env("1.3b", tmp_path, fake_python(tmp_path)))
    assert res.returncode == 2 and "set STUDENT_LOAD (the causal init" in res.stderr
