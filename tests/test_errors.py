"""Bad inputs fail early with a message naming the flag / file / shard to fix.

In-process where a library function is the checker (arguments, config, data, checkpoint), and a
few end-to-end runs of launch/pretrain_flow.py (non-zero exit, the message on stderr, and no
training iteration logged) for the checks that happen inside the trainer's start-up.
"""
import os
import re

import pytest
import torch

from dmd2_mega.arguments import parse_flow_args
from dmd2_mega.train.checkpoint import (TRACKER, check_writable, iter_dir, latest_iteration, load_model_weights,
                                  load_payload, rank_file)
from dmd2_mega.config import TrainConfig
from dmd2_mega.data import build_dataset, write_shards
from dmd2_mega.errors import CheckpointError, ConfigError, DataError
from dmd2_mega.models import MODEL_SIZES, DataShape, build_model
from dmd2_mega.distributed.parallel import ParallelState
from tests.utils import PRETRAIN, python, world_of_one

pytestmark = pytest.mark.timeout(120)

FAST = ["--model-size", "debug", "--train-iters", "2", "--micro-batch-size", "4", "--log-interval", "1"]


def ps_of(tp_size: int = 1, tp_rank: int = 0) -> ParallelState:
    """A ParallelState for the checkpoint readers (they only read tp_size / tp_rank)."""
    return ParallelState(rank=tp_rank, world_size=tp_size, local_rank=tp_rank, tp_rank=tp_rank, tp_size=tp_size,
                         dp_rank=0, dp_size=1, device=torch.device("cpu"), backend="gloo")


def assert_fails(res, *needles):
    assert res.returncode != 0, f"expected a failure\n{res.tail()}"
    for n in needles:
        assert n in res.stderr, f"stderr should name {n!r}\n{res.tail()}"
    assert "iteration        1/" not in res.stdout, f"training started before the check\n{res.tail()}"


# ---- flags -------------------------------------------------------------------------------------

@pytest.mark.integration
def test_unknown_model_size_end_to_end():
    res = python(PRETRAIN, ["--model-size", "nope", "--train-iters", "1"], timeout=90)
    assert_fails(res, "ConfigError", "--model-size 'nope' is unknown", "debug")


@pytest.mark.integration
def test_tp_not_dividing_world_size_end_to_end():
    res = python(PRETRAIN, FAST + ["--tensor-model-parallel-size", "2"], timeout=90)
    assert_fails(res, "ConfigError", "--tensor-model-parallel-size 2 does not divide the world size 1")


@pytest.mark.parametrize("size", sorted(MODEL_SIZES))
def test_heads_not_divisible_by_tp(size):
    heads = MODEL_SIZES[size].spec.num_heads
    tp = 3 if heads % 3 else 5
    with pytest.raises(ConfigError, match=rf"--tensor-model-parallel-size {tp} must divide .*\({heads}\).*{size}"):
        build_model(size, DataShape(1, 8, num_classes=10), tp_size=tp)


@pytest.mark.parametrize("micro,glob,dp", [(8, 20, 1), (8, 24, 2), (4, 6, 1)])
def test_global_batch_not_divisible(micro, glob, dp):
    cfg = parse_flow_args(["--micro-batch-size", str(micro), "--global-batch-size", str(glob)])
    with pytest.raises(ConfigError, match=rf"--global-batch-size \({glob}\) must be a multiple of "
                                          rf"--micro-batch-size x data-parallel size \({micro} x {dp}"):
        cfg.train.resolve_batches(dp)


def test_global_batch_divisible_resolves():
    t = TrainConfig(micro_batch_size=8, global_batch_size=32)
    assert t.resolve_batches(2) == 2
    t = TrainConfig(micro_batch_size=8)
    assert t.resolve_batches(4) == 1 and t.global_batch_size == 32


@pytest.mark.parametrize("flags,needle", [
    (["--micro-batch-size", "0"], "--micro-batch-size"),
    (["--cond-dropout", "1.0"], "--cond-dropout"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size"),
    (["--lr", "0"], "--lr"),
    (["--distributed-backend", "mpi"], "--distributed-backend"),
])
def test_bad_flag_values(flags, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_flow_args(flags)


# ---- data --------------------------------------------------------------------------------------

def _shards(path, n=6):
    g = torch.Generator().manual_seed(0)
    write_shards(str(path), torch.randn(n, 1, 4, 4, generator=g), labels=torch.arange(n) % 3, shard_size=4)
    return str(path)


def test_valid_shards_load(tmp_path):
    ds = build_dataset(_shards(tmp_path / "ok"))
    assert len(ds) == 6 and ds.num_classes == 3 and ds.image_size == 4


@pytest.mark.parametrize("key,bad,needle", [
    ("latents", torch.zeros(2, 1, 4, 4, dtype=torch.int32), "floating dtype"),
    ("labels", torch.zeros(2, dtype=torch.float32), "integer dtype"),
])
def test_shard_with_wrong_dtype_names_the_shard(tmp_path, key, bad, needle):
    from safetensors.torch import load_file, save_file
    path = _shards(tmp_path / "bad")
    shard = os.path.join(path, "shard_00001.safetensors")
    tensors = load_file(shard)
    tensors[key] = bad
    save_file(tensors, shard)
    with pytest.raises(DataError) as e:
        build_dataset(path)
    msg = str(e.value)
    assert shard in msg and key in msg and needle in msg, msg


def test_data_not_a_directory(tmp_path):
    with pytest.raises(DataError, match="--data"):
        build_dataset(str(tmp_path / "missing"))


# ---- checkpoints -------------------------------------------------------------------------------

def test_missing_load_directory(tmp_path):
    missing = str(tmp_path / "no_such_ckpt")
    with pytest.raises(CheckpointError, match=re.escape(f"--load directory '{missing}' does not exist")):
        latest_iteration(missing)
    with pytest.raises(CheckpointError, match="--load"):
        load_payload(missing, ps_of())


@pytest.mark.integration
def test_missing_load_directory_end_to_end(tmp_path):
    missing = str(tmp_path / "no_such_ckpt")
    res = python(PRETRAIN, FAST + ["--load", missing], timeout=90)
    assert_fails(res, "CheckpointError", f"--load directory '{missing}' does not exist")


def _fake_checkpoint(root, iteration=5, tp=1) -> list:
    paths = []
    for r in range(tp):
        path = rank_file(iter_dir(str(root), iteration), r)
        os.makedirs(os.path.dirname(path))
        torch.save({"iteration": iteration, "tp_size": tp, "model": {"w": torch.randn(64, 64)},
                    "partition_dims": {"w": 0}}, path)
        paths.append(path)
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write(str(iteration))
    return paths


def test_truncated_checkpoint_names_the_file(tmp_path):
    (path,) = _fake_checkpoint(tmp_path)
    assert load_payload(str(tmp_path), ps_of())["iteration"] == 5  # intact: loads
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CheckpointError) as e:
        load_payload(str(tmp_path), ps_of())
    assert path in str(e.value) and "truncated or corrupt" in str(e.value)


def test_missing_tp_shard_names_the_file(tmp_path):
    paths = _fake_checkpoint(tmp_path, tp=2)
    full = torch.cat([torch.load(p)["model"]["w"] for p in paths])
    assert torch.equal(load_payload(str(tmp_path), ps_of(1))["model"]["w"], full)  # resharded 2 -> 1
    os.remove(paths[1])
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint file {paths[1]} is missing")):
        load_payload(str(tmp_path), ps_of(1))


def test_garbage_tracker_names_the_file(tmp_path):
    _fake_checkpoint(tmp_path)
    with open(os.path.join(tmp_path, TRACKER), "w") as f:
        f.write("latest\n")
    with pytest.raises(CheckpointError, match=rf"{TRACKER} should hold an iteration number, found 'latest'"):
        load_payload(str(tmp_path), ps_of())


def test_empty_load_directory_is_a_fresh_start(tmp_path):
    assert load_payload(str(tmp_path), ps_of()) is None


def test_architecture_mismatch_names_parameter_and_shapes():
    with world_of_one():
        a = build_model("debug", DataShape(1, 8, num_classes=10))
        b = build_model("debug", DataShape(3, 8, num_classes=10))
        with pytest.raises(CheckpointError, match=r"--load ck: parameter x_embed.weight has shape \(32, 12\) "
                                                  r"in the checkpoint but \(32, 4\)"):
            load_model_weights(a, b.state_dict(), "--load ck")
        c = build_model("digits", DataShape(1, 8, num_classes=10))
        with pytest.raises(CheckpointError, match=r"architecture mismatch.*--model-size"):
            load_model_weights(a, c.state_dict(), "--load ck")
        load_model_weights(a, build_model("debug", DataShape(1, 8, num_classes=10)).state_dict(),
                           "--load ck")  # the matching one loads


def test_save_under_a_regular_file(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match=re.escape(f"--save directory '{blocker}/ckpt' is not writable")):
        check_writable(str(blocker / "ckpt"))
    check_writable(str(tmp_path / "fine"))
    assert os.listdir(tmp_path / "fine") == []  # the probe file is removed


@pytest.mark.integration
def test_save_under_a_regular_file_end_to_end(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    res = python(PRETRAIN, FAST + ["--save", blocker / "ckpt"], timeout=90)
    assert_fails(res, "CheckpointError", f"--save directory '{blocker}/ckpt' is not writable")
