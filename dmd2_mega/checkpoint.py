"""Megatron-layout checkpoints, written atomically, loadable at another TP degree (weights).

Layout:
    <save>/latest_checkpointed_iteration.txt          "100"
    <save>/iter_0000100/mp_rank_00/model_optim_rng.pt  one file per TP rank (DP rank 0 writes)
Each file holds: model (this TP rank's shard), optimizer, LR schedule, sampler position, RNG
states, iteration, args, tp_size, and the TP partition dim of every parameter.

Atomicity: ranks write into `iter_0000100.tmp/`, each file via `*.tmp` + os.replace; after a
barrier rank 0 renames the directory to `iter_0000100/`, then replaces the tracker file. A crash
at any point leaves the previous checkpoint and tracker intact, and no `iter_*` directory that
looks complete and is not.

Resharding: a checkpoint saved at TP=a loads its weights at TP=b by concatenating every sharded
parameter over the a files along its partition dim and slicing b ways. Optimizer state is not
resharded: resuming it at another TP degree is an error naming both degrees.
"""
from __future__ import annotations

import os
import shutil
from typing import Optional

import torch

from dmd2_mega.models.dit import tp_partition_dim
from dmd2_mega.parallel import ParallelState, barrier

TRACKER = "latest_checkpointed_iteration.txt"
FILENAME = "model_optim_rng.pt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message names the file and the reason."""


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_file(root: str, iteration: int, tp_rank: int) -> str:
    return os.path.join(iter_dir(root, iteration), f"mp_rank_{tp_rank:02d}", FILENAME)


def partition_dims(model: torch.nn.Module) -> dict:
    return {name: tp_partition_dim(p) for name, p in model.named_parameters()}


def rng_state() -> dict:
    from dmd2_mega.megatron_compat import rng_tracker_states
    state = {"cpu": torch.get_rng_state(), "tracker": rng_tracker_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from dmd2_mega.megatron_compat import set_rng_tracker_states
    torch.set_rng_state(state["cpu"])
    set_rng_tracker_states(state["tracker"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_torch_save(obj, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_writable(root: str) -> None:
    """Fail early (before training) if `--save` cannot be written."""
    try:
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f".write_probe_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"--save directory {root!r} is not writable: {e}") from e


def save_checkpoint(root: str, iteration: int, payload: dict, ps: ParallelState) -> str:
    """Collective over all ranks. `payload` is this rank's dict (model shard, optimizer, ...)."""
    final, tmp = iter_dir(root, iteration), iter_dir(root, iteration) + ".tmp"
    if ps.is_main:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    if ps.dp_rank == 0:
        rank_dir = os.path.join(tmp, f"mp_rank_{ps.tp_rank:02d}")
        os.makedirs(rank_dir, exist_ok=True)
        _atomic_torch_save(payload, os.path.join(rank_dir, FILENAME))
    barrier()
    if ps.is_main:
        if os.path.exists(final):  # re-saving an iteration: move the old one aside first
            shutil.rmtree(final + ".old", ignore_errors=True)
            os.replace(final, final + ".old")
        os.replace(tmp, final)
        _fsync_dir(root)
        tracker_tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tracker_tmp, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tracker_tmp, os.path.join(root, TRACKER))
        shutil.rmtree(final + ".old", ignore_errors=True)
    barrier()
    return final


def latest_iteration(root: str) -> Optional[int]:
    """The iteration in the tracker file; None if `root` exists but holds no checkpoint yet."""
    if not os.path.isdir(root):
        raise CheckpointError(f"--load directory {root!r} does not exist")
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} should hold an iteration number, found {text[:40]!r}")
    return int(text)


def _read(path: str) -> dict:
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated / corrupt pickle or zip
        raise CheckpointError(f"checkpoint file {path} is unreadable (truncated or corrupt?): {e}") from e


def load_payload(root: str, ps: ParallelState, iteration: Optional[int] = None) -> Optional[dict]:
    """This rank's payload, with `model` resharded to the current TP degree if it differs.

    Adds `saved_tp_size` to the payload. Returns None if `root` holds no checkpoint yet.
    """
    if iteration is None:
        iteration = latest_iteration(root)
        if iteration is None:
            return None
    first = _read(rank_file(root, iteration, 0 if ps.tp_size > 1 else ps.tp_rank))
    saved_tp = int(first["tp_size"])
    if saved_tp == ps.tp_size:
        payload = first if ps.tp_rank == 0 else _read(rank_file(root, iteration, ps.tp_rank))
    else:
        shards = [first] + [_read(rank_file(root, iteration, r))["model"] for r in range(1, saved_tp)]
        payload = dict(first)
        payload["model"] = _reshard(first, shards, ps.tp_rank, ps.tp_size, saved_tp)
    payload["saved_tp_size"] = saved_tp
    return payload


def _reshard(first: dict, shards: list, tp_rank: int, tp_size: int, saved_tp: int) -> dict:
    models = [first["model"]] + shards[1:]
    dims = first["partition_dims"]
    out = {}
    for name, tensor in models[0].items():
        dim = dims.get(name)
        if dim is None:
            out[name] = tensor
            continue
        full = torch.cat([m[name] for m in models], dim=dim)
        if full.shape[dim] % tp_size:
            raise CheckpointError(f"parameter {name} (size {full.shape[dim]} along dim {dim}) cannot be split "
                                  f"for --tensor-model-parallel-size {tp_size} (saved at {saved_tp})")
        out[name] = full.chunk(tp_size, dim=dim)[tp_rank].clone()
    return out


def load_model_weights(model: torch.nn.Module, state: dict, source: str) -> None:
    """Strict load that names the first mismatching parameter and both shapes."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise CheckpointError(f"{source}: architecture mismatch: missing {missing[:3]}, unexpected {unexpected[:3]} "
                              f"(was it saved with another --model-size?)")
    for k, v in own.items():
        if torch.is_tensor(v) and tuple(v.shape) != tuple(state[k].shape):  # not _extra_state (None)
            raise CheckpointError(f"{source}: parameter {k} has shape {tuple(state[k].shape)} in the checkpoint "
                                  f"but {tuple(v.shape)} in this model (another --model-size or data shape?)")
    model.load_state_dict(state)

