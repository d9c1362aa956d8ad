"""Bad input through the launch scripts: exit status 1, ONE line `<Error>: <message>` on stderr that
names the file / flag / parameter and what was expected, and the last good checkpoint untouched
(every file's sha256 equal before and after the failed run).

In-process through launch/pretrain_{flow,dmd2}.py `main()` (its return value is the exit status;
stderr via capsys), plus two real subprocesses (a non-finite shard, a DMD2 flag out of range) for
the exit status and stderr of the process itself. Checkpoints: the debug teacher (flow, 10
iterations) and a 2-cycle DMD2 student + critic, trained in-process once per module.
"""
import hashlib
import importlib.util
import os
import re
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file, save_file

from dmd2_mega.arguments import parse_dmd2_args, parse_flow_args
from dmd2_mega.train.checkpoint import iter_dir, latest_iteration, rank_file
from dmd2_mega.data import write_shards
from dmd2_mega.methods.dmd2.method import DMD2Trainer
from dmd2_mega.teacher_trainer import FlowTrainer
from tests.utils import PRETRAIN, PRETRAIN_DMD2, run, world_of_one

pytestmark = pytest.mark.timeout(240)

FLOW = ["--model-size", "debug", "--micro-batch-size", "4", "--lr", "3e-3", "--log-interval", "1", "--seed", "5"]


def dmd2_args(teacher: str) -> list:
    return ["--model-size", "debug", "--teacher-load", teacher, "--micro-batch-size", "4", "--lr", "1e-3",
            "--dmd2-critic-steps-per-rollout", "2", "--log-interval", "1", "--seed", "3", "--no-offload-inactive"]


def _main(script: str):
    spec = importlib.util.spec_from_file_location(f"launch_{os.path.basename(script)[:-3]}", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


MAIN = {"flow": _main(PRETRAIN), "dmd2": _main(PRETRAIN_DMD2)}


def tree_hash(*roots: str) -> dict:
    out = {}
    for root in roots:
        for d, _, files in os.walk(root):
            for f in files:
                if f == ".dmd2_mega.lock":  # the run lock (run_lock.py) names its latest holder: not checkpoint data
                    continue
                p = os.path.join(d, f)
                out[p] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def fails(capsys, kind: str, argv: list, *needles: str, keep=()) -> str:
    """Run `kind`'s main(argv): exit status 1, one stderr line holding every needle, no training,
    and every file under `keep` unchanged."""
    before = tree_hash(*keep)
    with world_of_one():
        rc = MAIN[kind]([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 1, f"expected exit status 1, got {rc}\n{out[-2000:]}\n{err[-2000:]}"
    assert len(err.strip().splitlines()) == 1, err
    for n in needles:
        assert n in err, f"stderr should name {n!r}: {err}"
    assert " iteration        1/" not in out, "training started before the check"
    assert tree_hash(*keep) == before, "the failed run changed the last good checkpoint"
    return err


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("rel_inputs")
    teacher, student = str(d / "teacher"), str(d / "student")
    with world_of_one():
        FlowTrainer(parse_flow_args(FLOW + ["--train-iters", "10", "--save", teacher])).train()
    with world_of_one():
        DMD2Trainer(parse_dmd2_args(dmd2_args(teacher) + ["--train-iters", "2", "--save", student])).train()
    return {"teacher": teacher, "student": student}


def copy_of(src: str, dst) -> str:
    shutil.copytree(src, dst)
    if os.path.isdir(src + "_critic"):
        shutil.copytree(src + "_critic", str(dst) + "_critic")
    return str(dst)


# ---- checkpoints -------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncated", "bit-flip"])
def test_damaged_checkpoint_file(ckpts, tmp_path, capsys, damage):
    ck = copy_of(ckpts["teacher"], tmp_path / "ck")
    path = rank_file(iter_dir(ck, 10), 0)
    data = bytearray(open(path, "rb").read())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x40  # inside a tensor: torch.load alone would load it silently
    open(path, "wb").write(bytes(data))
    needle = "is unreadable (truncated or corrupt?)" if damage == "truncated" else "fails the CRC-32 check"
    fails(capsys, "flow", FLOW + ["--train-iters", "12", "--load", ck, "--save", ck],
          "CheckpointError", f"checkpoint file {path} ", needle, keep=[ck])


def test_missing_critic_directory(ckpts, tmp_path, capsys):
    ck = copy_of(ckpts["student"], tmp_path / "s")
    shutil.rmtree(ck + "_critic")
    fails(capsys, "dmd2", dmd2_args(ckpts["teacher"]) + ["--train-iters", "4", "--load", ck],
          "CheckpointError", f"--load {ck}: the critic directory {ck}_critic is missing", keep=[ck])
    # --save = --load (a resume): the same, and the failed start creates no <save>_critic (issue 50, defect 11)
    fails(capsys, "dmd2", dmd2_args(ckpts["teacher"]) + ["--train-iters", "4", "--load", ck, "--save", ck],
          "CheckpointError", f"--load {ck}: the critic directory {ck}_critic is missing", keep=[ck])
    assert not os.path.exists(ck + "_critic")
    os.makedirs(ck + "_critic")  # there, but without the student's cycle
    fails(capsys, "dmd2", dmd2_args(ckpts["teacher"]) + ["--train-iters", "4", "--load", ck, "--save", ck],
          "CheckpointError", f"--load {ck}: the critic directory {ck}_critic holds no checkpoint of cycle 2",
          keep=[ck])


def test_teacher_of_another_size(ckpts, tmp_path, capsys):
    args = dmd2_args(ckpts["teacher"])
    args[args.index("debug")] = "digits"
    fails(capsys, "dmd2", args + ["--train-iters", "2", "--save", tmp_path / "s"], "CheckpointError",
          f"--teacher-load {ckpts['teacher']}: parameter x_embed.weight has shape (32, 4) in the checkpoint but "
          f"(128, 4) in this model", "saved with --model-size debug; this run uses digits",
          keep=[ckpts["teacher"]])  # the teacher is built first (LoRA roles may share its weights)


def _as_tp2(root: str, it: int) -> None:
    """Rewrite root's iteration `it` (TP=1) as a TP=2 checkpoint: sharded parameters split in two."""
    p = torch.load(rank_file(iter_dir(root, it), 0), weights_only=False)
    for r in range(2):
        q = dict(p, tp_size=2, model={n: (w if p["partition_dims"].get(n) is None else
                                          w.chunk(2, dim=p["partition_dims"][n])[r].clone())
                                      for n, w in p["model"].items()})
        os.makedirs(os.path.dirname(rank_file(iter_dir(root, it), r)), exist_ok=True)
        torch.save(q, rank_file(iter_dir(root, it), r))


def test_dmd2_optimizer_at_another_tp_degree(ckpts, tmp_path, capsys):
    ck = copy_of(ckpts["student"], tmp_path / "s")
    for root in (ck, ck + "_critic"):
        _as_tp2(root, 2)
    fails(capsys, "dmd2", dmd2_args(ckpts["teacher"]) + ["--train-iters", "4", "--load", ck, "--save", ck],
          "CheckpointError", f"--load {ck} (student) was saved with --tensor-model-parallel-size 2 but this run "
          f"uses 1", "--no-load-optim", keep=[ck, ck + "_critic"])
    with world_of_one():  # --no-load-optim: the resharded weights (= the TP=1 originals), fresh optimizers
        tr = DMD2Trainer(parse_dmd2_args(dmd2_args(ckpts["teacher"]) + ["--train-iters", "4", "--load", ck,
                                                                        "--no-load-optim"]))
        orig = torch.load(rank_file(iter_dir(ckpts["student"] + "_critic", 2), 0), weights_only=False)["model"]
        assert tr.iteration == 0
        for n, w in tr.roles["critic"].model.state_dict().items():
            assert not torch.is_tensor(w) or torch.equal(w, orig[n]), n


def test_save_directory_not_writable(ckpts, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    fails(capsys, "dmd2", dmd2_args(ckpts["teacher"]) + ["--train-iters", "2", "--save", blocker / "s"],
          "CheckpointError", f"--save directory '{blocker}/s' is not writable")
    (tmp_path / "ok_critic").write_text("a file where the critic's directory goes")
    fails(capsys, "dmd2", dmd2_args(ckpts["teacher"]) + ["--train-iters", "2", "--save", tmp_path / "ok"],
          "CheckpointError", f"--save directory '{tmp_path}/ok_critic' is not writable")


# ---- data --------------------------------------------------------------------------------------

def _shards(path) -> str:
    g = torch.Generator().manual_seed(0)
    write_shards(str(path), torch.randn(12, 1, 4, 4, generator=g), labels=torch.arange(12) % 3, shard_size=6)
    return str(path)


def _damage(path: str, how: str) -> str:
    shard = os.path.join(path, "shard_00001.safetensors")
    t = load_file(shard)
    if how == "shape":
        t["latents"] = torch.zeros(6, 1, 4, 5)
    elif how == "dtype":
        t["latents"] = t["latents"].to(torch.int32)
    else:
        t["latents"][2, 0, 1, 1] = float("inf")
    save_file(t, shard)
    return shard


@pytest.mark.parametrize("how,needle", [("shape", "'latents' expected shape [6, 1, 4, 4], found [6, 1, 4, 5]"),
                                        ("dtype", "'latents' expected a floating dtype")])
def test_bad_latent_shard(ckpts, tmp_path, capsys, how, needle):
    data = _shards(tmp_path / "data")
    shard = _damage(data, how)
    ck = copy_of(ckpts["teacher"], tmp_path / "ck")
    fails(capsys, "flow", FLOW + ["--train-iters", "12", "--data", data, "--load", ck, "--save", ck],
          "DataError", f"{shard}: {needle}", keep=[ck])


@pytest.mark.parametrize("workers", [0, 2])
def test_nonfinite_latents_stop_the_run_where_read(tmp_path, capsys, workers):
    """Values are checked as the rows are read (start-up reads headers only): the run stops at the batch holding
    the bad sample, before its optimizer step, with one line naming the shard and the sample, from the training
    process or a DataLoader worker alike; the last save stays the last good state."""
    data = _shards(tmp_path / "data")
    shard = _damage(data, "nonfinite")
    with world_of_one():
        rc = MAIN["flow"]([str(a) for a in FLOW + ["--train-iters", "12", "--data", data, "--save", tmp_path / "s",
                                                   "--save-interval", "1", "--num-workers", str(workers)]])
    out, err = capsys.readouterr()
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert f"DataError: {shard}: 'latents' has 1 non-finite values (NaN/inf) in sample 2" in err, err
    done = len(re.findall(r" iteration +\d+/", out))  # iterations that trained and saved before the bad batch
    assert done < 3, out  # 12 samples, 4 per batch: the bad one is read within the first epoch
    assert latest_iteration(str(tmp_path / "s")) == (done or None), out


@pytest.mark.parametrize("how,workers", [("deleted", 0), ("truncated", 2)])
def test_shard_changed_mid_run_stops_with_one_line(tmp_path, capsys, monkeypatch, how, workers):
    """A shard deleted or truncated after iteration 2's save: the run stops at the first batch read from it after
    the change (with workers, after the batches they had read ahead) with ONE line naming the shard and what
    changed, exit 1; the checkpoints saved before stay complete and untouched and the last is the last iteration
    run."""
    data = _shards(tmp_path / "data")
    shard = os.path.join(data, "shard_00001.safetensors")
    size, save, saved = os.path.getsize(shard), str(tmp_path / "s"), {}
    real_save = FlowTrainer.save

    def save_then_change(self):
        real_save(self)
        if self.iteration == 2:
            saved.update(tree_hash(iter_dir(save, 1), iter_dir(save, 2)))
            os.remove(shard) if how == "deleted" else os.truncate(shard, size - 40)

    monkeypatch.setattr(FlowTrainer, "save", save_then_change)
    with world_of_one():
        rc = MAIN["flow"]([str(a) for a in FLOW + ["--train-iters", "12", "--data", data, "--save", save,
                                                   "--save-interval", "1", "--num-workers", str(workers)]])
    out, err = capsys.readouterr()
    what = f"deleted ({size} bytes" if how == "deleted" else f"truncated to {size - 40} bytes"
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"DataError: {shard}: the shard changed during the run: {what}"), err
    done = len(re.findall(r" iteration +\d+/", out))
    assert 2 <= done < 12 and latest_iteration(save) == done, out  # read ahead: at most 2 workers x 2 batches late
    iters = sorted(f for f in os.listdir(save) if f.startswith("iter_"))
    assert iters == [os.path.basename(iter_dir(save, i)) for i in range(1, done + 1)], iters  # no iter_N.tmp
    assert tree_hash(iter_dir(save, 1), iter_dir(save, 2)) == saved, "a checkpoint saved before the change changed"


def test_empty_data_directory(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    fails(capsys, "flow", FLOW + ["--train-iters", "2", "--data", tmp_path / "empty"],
          "DataError", f"--data {tmp_path / 'empty'}: empty data directory")


@pytest.mark.parametrize("flags,needle", [
    (["--dmd2-score-sigma-range", "0.6", "0.2"], "--dmd2-score-sigma-range needs 0 <= MIN < MAX <= 1, got 0.6 0.2"),
    (["--dmd2-teacher-guidance-scale", "0.5"], "--dmd2-teacher-guidance-scale must be >= 1, got 0.5"),
    (["--dmd2-critic-steps-per-rollout", "0"], "--dmd2-critic-steps-per-rollout must be >= 1, got 0"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
    (["--global-batch-size", "6"], "--global-batch-size (6) must be a multiple of --micro-batch-size x data-parallel"),
    (["--max-nan-iterations", "-1"], "--max-nan-iterations must be >= 0"),
    (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins must be > 0"),
], ids=["score-range", "guidance", "K", "micro-batch", "global-batch", "max-nan", "exit-duration"])
def test_dmd2_flag_out_of_range(ckpts, tmp_path, capsys, flags, needle):
    fails(capsys, "dmd2", dmd2_args(ckpts["teacher"]) + ["--train-iters", "2", "--save", tmp_path / "s"] + flags,
          "ConfigError", needle)
    assert not os.path.exists(tmp_path / "s_critic")


# ---- the real processes --------------------------------------------------------------------------

@pytest.mark.integration
def test_processes_exit_1_with_one_line(ckpts, tmp_path):
    data = _shards(tmp_path / "data")
    shard = _damage(data, "nonfinite")
    jobs = [[sys.executable, PRETRAIN] + FLOW + ["--train-iters", "2", "--data", data],
            [sys.executable, PRETRAIN_DMD2] + dmd2_args(ckpts["teacher"]) + ["--dmd2-teacher-guidance-scale", "0"]]
    with ThreadPoolExecutor(2) as pool:
        flow_res, dmd2_res = pool.map(lambda c: run(c, 120), jobs)
    for res, line in ((flow_res, f"DataError: {shard}: 'latents' has 1 non-finite values"),
                      (dmd2_res, "ConfigError: --dmd2-teacher-guidance-scale must be >= 1, got 0.0")):
        assert res.returncode == 1, res.tail()
        assert len(res.stderr.strip().splitlines()) == 1, res.tail()  # ONE line, no traceback
        assert res.stderr.strip().startswith(line) and "Traceback" not in res.stderr, res.tail()
