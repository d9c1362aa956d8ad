"""Shared helpers for the tests: launching the repo's scripts in subprocesses (plain Python or
torchrun: gloo ranks on a CPU machine, a GPU per rank on a CUDA one), reading their outputs, and a world-of-one
distributed context.

Every subprocess runs with OMP_NUM_THREADS=1, TORCH_COMPILE_DISABLE=1, no inherited torchrun
variables (RANK, WORLD_SIZE, MASTER_PORT, ...: `init_distributed` writes them into os.environ of
an in-process world of one, and a child that inherited them would try to bind the parent's port),
in its own process group, and under a timeout after which the whole group is killed, so a hung
rank fails the test instead of hanging it. Failures quote the tail of stdout and stderr. A world-of-one
`python script.py` run is a fork of the tests' fork server (tests/forkserver.py) where a fork is the same process.

On a CUDA machine (docs/testing.md, "On a GPU machine") a child sees the GPUs the tests see: a run's ranks take a
GPU each, as `init_distributed` gives them (NCCL, cuda:LOCAL_RANK), so a run of more ranks than the machine has GPUs
is skipped with a reason that says so (`rank_devices`); the scripts of `HOST_RANK_SCRIPTS` run gloo on host tensors by
design, on any machine, with CUDA hidden. Every run there is a fresh interpreter, not a fork: a process that has
touched the CUDA driver cannot hand it to a fork.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

import pytest
import torch

from tests import forkserver

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MP_SCRIPTS = os.path.join(REPO, "tests", "mp_scripts")
PRETRAIN = os.path.join(REPO, "launch", "pretrain_flow.py")
SAMPLE = os.path.join(REPO, "launch", "sample.py")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0  # the GPUs the tests see (0: a CPU machine)
# Test scripts whose ranks run gloo on host tensors by design (the collectives' maths on the CPU), on any machine.
HOST_RANK_SCRIPTS = frozenset({"dist_optim_dp.py", "grad_buffer_dp.py", "qk_norm_rope_tp.py"})

# Variables torchrun / init_distributed set; never inherited by a child.
_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
              "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
              "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def child_env(extra: Optional[dict] = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    env.update(OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.path.join(REPO, "kernels"), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


@dataclass
class Result:
    cmd: list
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def tail(self, n: int = 4000) -> str:
        return (f"command: {' '.join(self.cmd)}\nexit code: {self.returncode} after {self.seconds:.1f} s\n"
                f"--- stdout (tail) ---\n{self.stdout[-n:]}\n--- stderr (tail) ---\n{self.stderr[-n:]}")

    def check(self, what: str = "subprocess") -> "Result":
        assert self.returncode == 0, f"{what} failed\n{self.tail()}"
        return self


def run(cmd: Sequence[str], timeout: float = 120, extra_env: Optional[dict] = None) -> Result:
    """Run `cmd` from the repo root; on timeout kill its whole process group and fail. A `python [-u] script.py`
    run is forked from the tests' fork server where a fork is the same process (tests/forkserver.py)."""
    cmd = [str(c) for c in cmd]
    start = time.time()
    ranks = None if GPUS else forkserver.torchrun_ranks(cmd, extra_env)  # CUDA: fresh interpreters (docstring)
    if ranks is not None:
        proc = forkserver.ForkedRun(ranks[1], child_env(extra_env), REPO, nproc=ranks[0])
    elif not GPUS and forkserver.forkable(cmd, extra_env):
        proc = forkserver.ForkedRun(cmd, child_env(extra_env), REPO)
    else:
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(extra_env), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        res = Result(cmd, -9, out, err, time.time() - start)
        raise AssertionError(f"timed out after {timeout} s (a hung rank?)\n{res.tail()}")
    return Result(cmd, proc.returncode, out, err, time.time() - start)


LOGGED = re.compile(r"^ iteration +(\d+)/", re.M)
"""A training log line; group 1 is its iteration (cycle)."""


def signal_when_logged(cmd: Sequence, sig: int, iteration: int = 1, timeout: float = 180) -> Result:
    """Start `cmd` from the repo root in its own session (with SIGINT's default disposition: a shell may have it
    ignored), send it `sig` once a log line of iteration >= `iteration` appears, and return its Result; its
    process group is SIGKILLed after `timeout` s."""
    cmd = [str(c) for c in cmd]
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            m = LOGGED.match(line)
            if m and int(m.group(1)) >= iteration:
                proc.send_signal(sig)
                break
        rest, err = proc.communicate()
    finally:
        timer.cancel()
    return Result(cmd, proc.returncode, "".join(out) + rest, err, time.time() - start)


def python(script: str, args: Sequence = (), timeout: float = 120) -> Result:
    """A world of one: `python script args` (init_distributed makes a single-rank gloo world)."""
    return run([sys.executable, script, *args], timeout=timeout)


def rank_devices(nproc: int, script) -> dict:
    """What a run of `nproc` ranks of `script` needs in its environment on this machine: nothing on a CPU machine
    (gloo ranks); on a CUDA one, a GPU per rank (the run is skipped, saying so, where there are fewer), except the
    `HOST_RANK_SCRIPTS`, which run on the host with CUDA hidden."""
    if not GPUS:
        return {}
    if os.path.basename(str(script)) in HOST_RANK_SCRIPTS:
        return {"CUDA_VISIBLE_DEVICES": ""}
    if GPUS < nproc:
        pytest.skip(f"needs {nproc} GPUs (one per rank under NCCL); this machine has {GPUS}: a CPU machine runs it "
                    f"with {nproc} gloo ranks")
    return {}


def torchrun(nproc: int, script: str, args: Sequence = (), timeout: float = 180,
             extra_env: Optional[dict] = None) -> Result:
    """`torchrun --standalone --nproc-per-node nproc script args` with the venv's interpreter, on the devices
    `rank_devices` gives it."""
    env = {**rank_devices(nproc, script), **(extra_env or {})}
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "--monitor-interval=0.1", script, *args], timeout=timeout, extra_env=env or None)


def launch(nproc: int, script: str, args: Sequence = (), timeout: float = 180) -> Result:
    """nproc 1 -> plain python (saves torchrun's start-up), else torchrun."""
    return python(script, args, timeout) if nproc == 1 else torchrun(nproc, script, args, timeout)


def run_parallel(jobs: dict, workers: int = 2) -> dict:
    """{name: thunk} -> {name: its result}, `workers` at a time: every rank is one thread (OMP_NUM_THREADS=1), so two
    single-rank runs, or one two-rank run and one more, keep both cores busy."""
    with ThreadPoolExecutor(workers) as pool:
        futs = {k: pool.submit(f) for k, f in jobs.items()}
        return {k: f.result() for k, f in futs.items()}


def read_trace(path: str) -> list:
    """The JSON-lines loss trace written by --loss-trace: [{"iteration", "loss", "grad_norm", "lr"}]."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# A trace value that is a difference of two terms can be far smaller than either, so a tolerance relative to it asks
# for more than the terms' own fp32 rounding: its scale is floored. gan-logit-gap = mean D(real) - mean D(fake) was
# 3.6e-5 at one cycle of test_dit_dmd2, and TP=2 and TP=1 differed there by 4.4e-10 (1.2e-5 relative) under
# ATEN_CPU_CAPABILITY=default; floored at 1e-3, rtol 1e-5 allows 1e-8 for a gap below 1e-3.
TRACE_SCALE_FLOORS = {"gan-logit-gap": 1e-3}


def assert_traces_close(a: list, b: list, rtol: float, what: str, keys=("loss", "grad_norm", "lr")) -> None:
    """Per iteration and key, |a - b| <= rtol * max(|b|, floor): floor 1e-12, or the key's TRACE_SCALE_FLOORS."""
    assert [r["iteration"] for r in a] == [r["iteration"] for r in b], f"{what}: iterations differ: {a} vs {b}"
    for ra, rb in zip(a, b):
        for k in keys:
            x, y = ra[k], rb[k]
            scale = max(abs(y), TRACE_SCALE_FLOORS.get(k, 1e-12)) if rtol > 0 else 1.0
            assert abs(x - y) <= rtol * scale, \
                f"{what}: iteration {ra['iteration']} {k}: {x!r} vs {y!r} (rel {abs(x - y) / max(abs(y), 1e-12):.2e})"


def find_tmp(root: str) -> list:
    """Every path under `root` whose name ends in .tmp (left-overs of a non-atomic save)."""
    hits = []
    for dirpath, dirnames, filenames in os.walk(root):
        hits += [os.path.join(dirpath, n) for n in dirnames + filenames if n.endswith(".tmp") or ".tmp." in n]
    return hits


@contextlib.contextmanager
def world_of_one(tp: int = 1, seed: int = 1234):
    """In-process `init_distributed(ParallelConfig())` for a test module; restores os.environ and
    tears the (global) megatron parallel state down afterwards."""
    from dmd2_mega.config import ParallelConfig
    from dmd2_mega.distributed.parallel import destroy_distributed, init_distributed

    saved = {k: os.environ.get(k) for k in _DIST_VARS}
    try:
        yield init_distributed(ParallelConfig(tensor_model_parallel_size=tp), seed=seed)
    finally:
        destroy_distributed()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---- DMD2 (launch/pretrain_dmd2.py) ------------------------------------------------------------

PRETRAIN_DMD2 = os.path.join(REPO, "launch", "pretrain_dmd2.py")
# Per-cycle keys of the DMD2 --loss-trace (one JSON line per cycle, besides "iteration").
DMD2_TRACE_KEYS = ("critic-loss", "critic-grad_norm", "actor-dmd-loss", "actor-grad_norm", "dmd-normaliser",
                   "dmd-fake-real-gap", "dmd-grad-rms")


RESUMABLE_FLOW = ["--model-size", "debug", "--micro-batch-size", "8", "--lr", "3e-3", "--log-interval", "1", "--seed",
                  "5", "--lr-decay-iters", "1000"]
"""Debug flow-model flags for the save / resume tests: a fixed --lr-decay-iters, so resumes with another
--train-iters keep the LR schedule (else an error, issue 13)."""


def resumable_dmd2_args(teacher: str) -> list:
    """Debug DMD2 flags for the save / resume tests (fixed --lr-decay-iters, no offload)."""
    return ["--model-size", "debug", "--teacher-load", teacher, "--micro-batch-size", "4", "--lr", "1e-3",
            "--dmd2-critic-steps-per-rollout", "2", "--log-interval", "1", "--seed", "3", "--no-offload-inactive",
            "--lr-decay-iters", "1000"]


def train_debug_teacher(save: str, iters: int = 10, seed: int = 5, timeout: float = 120) -> str:
    """A deterministic debug-size flow-matching teacher in `save` (Megatron layout), for DMD2 tests:
    `iters` AdamW steps at lr 3e-3 from the seeded init (enough to move every weight off its init)."""
    python(PRETRAIN, ["--model-size", "debug", "--train-iters", str(iters), "--micro-batch-size", "8",
                      "--lr", "3e-3", "--seed", str(seed), "--log-interval", str(iters), "--save", save],
           timeout=timeout).check("teacher pretraining for the DMD2 tests")
    return save


def wan_digits_teacher(save: str, iters: int, *more: str) -> str:
    """A wan-digits flow-matching teacher on `--data moving-digits` in `save`, trained in process (a world of one)
    for `iters` steps at micro-batch 4 (`more`: further pretrain_flow.py flags)."""
    from launch import pretrain_flow
    with world_of_one():
        assert pretrain_flow.main(["--model-size", "wan-digits", "--data", "moving-digits", "--micro-batch-size", "4",
                                   "--global-batch-size", "4", "--train-iters", str(iters), "--save", save,
                                   *more]) == 0
    return save


def tiny_wan_transformer(seed: int = 0, **config):
    """A random diffusers `WanTransformer3DModel` of the wan-debug sizes (`config` overrides), its weights moved off
    diffusers' zero-initialised ones so that every parameter matters."""
    import warnings
    import torch
    from diffusers import WanTransformer3DModel
    from dmd2_mega.models import get_spec
    cfg = {**get_spec("wan-debug").diffusers_config(), **config}
    cfg.pop("_class_name")
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = WanTransformer3DModel(**cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def tiny_wan_pipeline_parts(words: Sequence[str] = ("a", "cat"), latents_mean: Sequence[float] = (0.0,) * 4,
                            latents_std: Sequence[float] = (1.0,) * 4) -> dict:
    """The text and VAE parts of a tiny Wan pipeline (nothing downloaded): a word-level tokenizer over `words`, a
    1-layer UMT5 (d_model 16: wan-debug's text_dim), an AutoencoderKLWan with 4 latent channels (4x in time, 8x in
    space; the given normalisation) and FlowMatchEulerDiscreteScheduler(shift=3); WanPipeline and
    WanImageToVideoPipeline take them as keywords."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel
    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "<unk>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return dict(tokenizer=PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                                  unk_token="<unk>"),
                text_encoder=UMT5EncoderModel(UMT5Config(
                    vocab_size=len(vocab), d_model=16, d_kv=4, num_heads=2, d_ff=32, num_layers=1,
                    relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)),
                vae=AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True], latents_mean=list(latents_mean),
                                     latents_std=list(latents_std)),
                scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))


def tiny_clip_parts(hidden: int) -> dict:
    """A tiny CLIP image encoder and its processor (Wan 2.1 I2V's image_encoder / image_processor): 28 px images in
    14 px patches, so its embedding is [5, hidden] (4 patches and the class token)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel
    return dict(image_encoder=CLIPVisionModel(CLIPVisionConfig(
                    hidden_size=hidden, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
                    image_size=28, patch_size=14)),
                image_processor=CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}))


def converted_wan_teacher(d, seed: int = 11, **config) -> tuple[str, str]:
    """(converted teacher, data) in folder d: a tiny random diffusers `WanTransformer3DModel` (the wan-debug sizes,
    `config` overriding them; weights perturbed off their init) saved and converted with
    launch/convert_checkpoint.py, and 32 random latents [4, 3, 4, 6] (or `latent` [C, T, H, W]) with text
    [5, 16] and a negative prompt in safetensors shards of 8."""
    import torch
    from dmd2_mega.data import write_shards
    latent = config.pop("latent", (4, 3, 4, 6))
    tiny_wan_transformer(seed, **config).save_pretrained(os.path.join(d, "tiny"))
    python(os.path.join(REPO, "launch", "convert_checkpoint.py"),
           ["--from-diffusers", os.path.join(d, "tiny"), "--save", os.path.join(d, "teacher")]).check("convert")
    g = torch.Generator().manual_seed(0)
    lat, cond = torch.randn(32, *latent, generator=g), torch.randn(32, 5, 16, generator=g)
    write_shards(os.path.join(d, "data"), lat, cond=cond, shard_size=8, negative=torch.randn(5, 16, generator=g))
    return os.path.join(d, "teacher"), os.path.join(d, "data")
