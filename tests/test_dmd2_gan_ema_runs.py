"""GAN head and student EMA through launch/pretrain_dmd2.py (debug DiT, CPU, gloo) and launch/sample.py.

Runs (the session's debug teacher; B = 4, K = 2, global batch 8, lr 1e-3, teacher CFG 2, --dmd2-gan
with weights 1 and 1 so that the GAN terms move the trace, --ema-decay 0.5 from cycle 2):
  ref      TP=1, 4 cycles, --no-offload-inactive, saved at 2 and 4
  dp2      the same at DP=2                      -> every trace key within 1e-5 relative of ref
  offload  the same with --offload-inactive      -> the identical trace; resident MB of the actor
           phase - that of the rollout phase (the student alone) = the critic's weights, counted
           from its checkpoint (weights only: no grads, no optimizer state)
  split    2 cycles, then --load and 2 more       -> ref's trace, and at cycle 4 bit-identical
           student weights, EMA and critic weights (GAN head included)
sample.py on ref's student uses the EMA weights (its samples equal generate_student with the
checkpoint's EMA loaded by hand) unless --no-ema (then those of the raw weights; the two differ).
The GAN head and the EMA at TP=2 (its trace and EMA weights equal TP=1's) are tests/test_dit_dmd2.py's.
"""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from dmd2_mega.arguments import parse_dmd2_args
from dmd2_mega.train.checkpoint import iter_dir, rank_file
from dmd2_mega.errors import ConfigError
from tests.utils import DMD2_TRACE_KEYS, PRETRAIN_DMD2, SAMPLE, assert_traces_close, launch, python, read_trace

pytestmark = pytest.mark.timeout(400)
INTEGRATION_FIXTURES = ("runs",)  # fixtures that launch processes: their tests are marked integration
GAN_KEYS = DMD2_TRACE_KEYS + ("gan-disc-loss", "gan-logit-gap", "actor-gan-loss")


@pytest.fixture(scope="module")
def runs(debug_teacher, tmp_path_factory):
    d = tmp_path_factory.mktemp("gan_ema")
    teacher = debug_teacher
    base = ["--model-size", "debug", "--teacher-load", teacher, "--micro-batch-size", "4", "--global-batch-size",
            "8", "--dmd2-critic-steps-per-rollout", "2", "--log-interval", "1", "--lr", "1e-3",
            "--lr-decay-iters", "10", "--dmd2-teacher-guidance-scale", "2", "--seed", "3", "--dmd2-gan",
            "--dmd2-gan-disc-weight", "1", "--dmd2-gan-gen-weight", "1", "--ema-decay", "0.5",
            "--ema-start-iter", "2"]

    def go(name, nproc, extra, iters=4, load=None):
        save = str(d / name)
        args = base + extra + ["--train-iters", str(iters), "--save", save, "--save-interval", "2",
                               "--loss-trace", str(d / f"{name}.jsonl")]
        args += ["--load", load] if load else []
        return launch(nproc, PRETRAIN_DMD2, args, timeout=240)

    jobs = {"ref": ("ref", 1, ["--no-offload-inactive"]), "offload": ("offload", 1, ["--offload-inactive"]),
            "dp2": ("dp2", 2, ["--no-offload-inactive"]), "split_a": ("split", 1, ["--no-offload-inactive"], 2)}
    with ThreadPoolExecutor(2) as pool:  # two runs at a time: each rank is one thread (OMP_NUM_THREADS=1)
        futs = {k: pool.submit(go, *job) for k, job in jobs.items()}
        res = {k: f.result() for k, f in futs.items()}
    res["split_b"] = go("split", 1, ["--no-offload-inactive"], iters=4, load=str(d / "split"))
    return {"d": d, "res": res, "teacher": teacher, "base": base}


def trace(runs, name):
    return read_trace(runs["d"] / f"{name}.jsonl")


def payload(root, it=4, rank=0):
    return torch.load(rank_file(iter_dir(root, it), rank), map_location="cpu", weights_only=False)


def test_gan_moves_the_trace(runs):
    runs["res"]["ref"].check("GAN TP=1")
    ref = trace(runs, "ref")
    assert [r["iteration"] for r in ref] == [1, 2, 3, 4]
    assert min(r["actor-gan-loss"] for r in ref) > 0.1 and max(abs(r["gan-logit-gap"]) for r in ref) > 1e-4


def test_dp2_with_gan_equals_dp1(runs):
    """DP=2 (one micro-batch per rank, the global indices of DP=1's two): the real samples and the
    GAN noise follow the micro-batch, so the trace is DP=1's."""
    out = runs["res"]["dp2"].check("GAN DP=2").stdout
    assert "TP=1 DP=2" in out and "M=1" in out
    assert_traces_close(trace(runs, "dp2"), trace(runs, "ref"), 1e-5, "GAN DP=2 vs DP=1", keys=GAN_KEYS)


def _resident(stdout: str, phase: str) -> list:
    return [float(x) for x in re.findall(rf"resident-MB-{phase}: ([0-9.]+)", stdout)]


def test_offload_with_gan_same_trace_and_actor_phase_holds_critic_weights(runs):
    out = runs["res"]["offload"].check("GAN --offload-inactive").stdout
    a, b = trace(runs, "offload"), trace(runs, "ref")
    assert a == b, "offload changed the numerics with the GAN head on"
    critic = payload(str(runs["d"] / "offload") + "_critic")["model"]
    # a GANCritic's state: the DiT trunk under trunk.*, the GAN head under head.*, nothing else
    assert any(k.startswith("head.") for k in critic) and any(k.startswith("trunk.") for k in critic)
    assert all(k.startswith(("trunk.", "head.")) for k in critic), sorted(critic)
    from dmd2_mega.models.registry import get_spec
    spec = get_spec("debug")
    pos = (8 // spec.patch_size) ** 2 * spec.hidden_size * 4  # the DiT's non-persistent position buffer
    critic_mb = (sum(t.numel() * t.element_size() for t in critic.values() if torch.is_tensor(t)) + pos) / 2**20
    actor, rollout = _resident(out, "actor"), _resident(out, "rollout")
    assert len(actor) == len(rollout) == 4
    assert actor[-1] - rollout[-1] == pytest.approx(critic_mb, abs=1.1e-3), (actor, rollout, critic_mb)  # 3 decimals
    no_off = _resident(runs["res"]["ref"].stdout, "actor")
    assert actor[-1] < no_off[-1]


def test_resume_restores_ema_and_gan_head_exactly(runs):
    runs["res"]["split_a"].check("GAN + EMA 2 cycles")
    out = runs["res"]["split_b"].check("GAN + EMA resume").stdout
    assert "resumed student and critic" in out and "at cycle 2" in out
    assert_traces_close(trace(runs, "split"), trace(runs, "ref"), 1e-7, "GAN + EMA 2 + resume + 2 vs 4",
                        keys=GAN_KEYS)
    ref, split = str(runs["d"] / "ref"), str(runs["d"] / "split")
    for suffix, keys in (("", ("model", "ema")), ("_critic", ("model",))):
        a, b = payload(split + suffix), payload(ref + suffix)
        for key in keys:
            assert a[key].keys() == b[key].keys()
            for n, w in b[key].items():
                if w is None:  # megatron linears' _extra_state
                    continue
                assert torch.equal(a[key][n], w), f"{key} {n} of {suffix or 'student'} differs after resume"
    ema, model = payload(ref)["ema"], payload(ref)["model"]
    assert all(ema[n].dtype == torch.float32 for n in ema)
    assert any(not torch.equal(ema[n], model[n].float()) for n in ema), "EMA should differ from the weights"


@pytest.mark.integration
def test_sample_uses_ema_unless_no_ema(runs, tmp_path):
    from dmd2_mega.train.checkpoint import load_model_weights
    from dmd2_mega.config import ModelConfig
    from dmd2_mega.sampling import generate_student
    from dmd2_mega.train.builders import build_model
    from tests.utils import world_of_one
    ref = str(runs["d"] / "ref")
    outs = {}
    for name, extra in (("ema", []), ("raw", ["--no-ema"])):
        r = python(SAMPLE, ["--load", ref, "--num-samples", "12", "--seed", "4", "--out", str(tmp_path / name),
                            *extra], timeout=120).check(f"sample.py {name}")
        assert ("EMA weights" if name == "ema" else "raw weights") in r.stdout
        outs[name] = np.load(tmp_path / name / "samples.npz")["images"]
    assert not np.array_equal(outs["ema"], outs["raw"])
    p = payload(ref)
    with world_of_one() as ps:
        for name, state in (("ema", {**p["model"], **p["ema"]}), ("raw", p["model"])):
            model = build_model(ModelConfig(**p["args"]["model"]), p["data_info"], ps)
            load_model_weights(model, state, "test")
            want = generate_student(model, torch.arange(12) % 10, torch.tensor(p["student_sigmas"]),
                                    shape=(1, 8, 8), seed=4, device=ps.device)
            np.testing.assert_allclose(outs[name], want.numpy(), rtol=0, atol=1e-6)


@pytest.mark.integration
def test_gan_mismatch_on_resume_is_named(runs, tmp_path):
    runs["res"]["split_b"].check("GAN + EMA resume")
    i = runs["base"].index("--dmd2-gan")  # the head and its two settings (alone they are refused: no effect)
    args = runs["base"][:i] + runs["base"][i + 5:]
    r = python(PRETRAIN_DMD2, args + ["--train-iters", "6", "--load", str(runs["d"] / "split")], timeout=120)
    assert r.returncode != 0 and "saved with the GAN head" in r.stderr + r.stdout, r.stderr[-2000:]


@pytest.mark.integration
def test_bad_feature_layer_named(runs):
    r = python(PRETRAIN_DMD2, runs["base"] + ["--train-iters", "1", "--dmd2-gan-feature-layer", "9"], timeout=120)
    assert r.returncode != 0 and "--dmd2-gan-feature-layer must be in [0, 1]" in r.stderr + r.stdout


@pytest.mark.parametrize("argv, message", [
    (["--dmd2-gan-disc-weight", "-1"], "--dmd2-gan-disc-weight"),
    (["--dmd2-gan-gen-weight", "-0.1"], "--dmd2-gan-gen-weight"),
    (["--dmd2-gan-feature-layer", "0"], "--dmd2-gan-feature-layer needs --dmd2-gan"),
    (["--dmd2-gan", "--dmd2-gan-sigma-range", "0.5", "0.2"], "--dmd2-gan-sigma-range needs 0 <= MIN < MAX"),
    (["--dmd2-gan", "--dmd2-gan-sigma-range", "0.4001", "0.4009"], "holds no point of the 1000-point"),
    (["--ema-decay", "1.0"], "--ema-decay"),
    (["--ema-start-iter", "-2"], "--ema-start-iter"),
])
def test_rejected_gan_and_ema_flags(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_dmd2_args(["--teacher-load", "x"] + argv)


def test_defaults_off():
    cfg = parse_dmd2_args(["--teacher-load", "x"])
    g, e = cfg.gan, cfg.ema
    assert (g.enabled, g.noise, g.disc_weight, g.gen_weight, e.decay, e.no_ema) == \
        (False, True, 1e-2, 3e-3, 0.0, False)
