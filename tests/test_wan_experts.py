"""Wan 2.2 A14B-style two-expert teachers: a tiny random pipeline folder (model_index.json with boundary_ratio 0.5,
transformer/ and transformer_2/ of one config, different weights) built here.

  * load_model routes each sample as WanPipeline does (t = 1000 sigma >= 1000 boundary -> transformer, else
    transformer_2): output and every gradient equal the diffusers experts run on their own samples (fp32, 1e-5);
  * diffusers pipeline folder -> one two-expert checkpoint at TP=2 -> transformer/ + transformer_2/ is bit-exact;
  * the two-expert checkpoint is one teacher role: a DMD2 cycle runs on it and the student holds both experts;
    time-sliced (--offload-inactive) the teacher keeps one expert resident at a time and the cycle is bit-identical.
"""
import json
import warnings

from diffusers import WanTransformer3DModel
import pytest
from safetensors.torch import load_file
import torch

from dmd2_mega.train.checkpoint import load_payload
from dmd2_mega.data import write_shards
from dmd2_mega.models import get_size, get_spec
from dmd2_mega.models.wan.diffusers import diffusers_name
from dmd2_mega.models.wan.experts import WanExperts
from dmd2_mega.pretrained import _one_process, export_diffusers, import_diffusers, load_model
from tests.utils import DMD2_TRACE_KEYS, PRETRAIN_DMD2, assert_traces_close, python, read_trace, world_of_one

pytestmark = pytest.mark.timeout(300)
WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    d = tmp_path_factory.mktemp("wan22") / "pipe"
    cfg = get_spec("wan-debug").diffusers_config()
    cfg.pop("_class_name")
    experts = []
    for i, sub in enumerate(("transformer", "transformer_2")):
        torch.manual_seed(100 + i)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = WanTransformer3DModel(**cfg).eval()
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.1 * torch.randn_like(p))
        m.save_pretrained(d / sub)
        experts.append(m)
    json.dump({"_class_name": "WanPipeline", "boundary_ratio": 0.5, "transformer": ["diffusers", "WanTransformer3DModel"],
               "transformer_2": ["diffusers", "WanTransformer3DModel"]}, open(d / "model_index.json", "w"))
    return d, experts


def test_routing_matches_the_pipeline_rule(pipeline):
    d, (high, low) = pipeline
    assert get_size(str(d)).spec.boundary_ratio == 0.5
    assert get_size(str(d / "transformer_2")).spec.boundary_ratio is None  # one expert's folder is one model
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(4, 4, 3, 4, 6, generator=g), torch.randn(4, 5, 16, generator=g)
    sigma = torch.tensor([0.3, 0.7, 0.5, 0.49])  # 0.5 is the boundary itself: t = 500 >= 500 -> high
    with world_of_one():
        model = load_model(str(d)).train()
        assert isinstance(model, WanExperts)
        out = model(x, sigma, cond)
        out.square().mean().backward()
    want = torch.empty_like(out)
    for m, idx in ((high, [1, 2]), (low, [0, 3])):
        i = torch.tensor(idx)
        want[i] = m(x[i], sigma[i] * 1000, cond[i]).sample
    assert float((out - want).abs().max()) <= 1e-5 * float(want.abs().max())
    want.square().mean().backward()
    grads = dict(model.named_parameters())
    for prefix, m in (("high.", high), ("low.", low)):
        names = {diffusers_name(n[len(prefix):]): n for n in grads if n.startswith(prefix)}
        for n, p in m.named_parameters():
            ours = grads[names[n]].grad.reshape(p.shape)
            assert float((ours - p.grad).abs().max()) <= 1e-5 * max(float(p.grad.abs().max()), 1e-6), n


@pytest.mark.integration
def test_two_expert_round_trip_and_dmd2(pipeline, tmp_path):
    d, _ = pipeline
    ckpt = tmp_path / "teacher"
    import_diffusers(str(d), str(ckpt), 2, log=lambda *_: None)  # in process: the CLI is test_wan_dmd2's
    export_diffusers(str(ckpt), str(tmp_path / "export"), log=lambda *_: None)
    for sub in ("transformer", "transformer_2"):
        a, b = load_file(d / sub / WEIGHTS), load_file(tmp_path / "export" / sub / WEIGHTS)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), sub
    g = torch.Generator().manual_seed(1)
    write_shards(str(tmp_path / "data"), torch.randn(8, 4, 3, 4, 6, generator=g), cond=torch.randn(8, 5, 16, generator=g))
    base = ["--model-size", ckpt, "--teacher-load", ckpt, "--data", tmp_path / "data", "--micro-batch-size", "2",
            "--dmd2-critic-steps-per-rollout", "2", "--train-iters", "1", "--dmd2-teacher-guidance-scale", "2"]
    for name, extra in (("run", []), ("sliced", ["--offload-inactive"])):  # the teacher's experts time-sliced
        python(PRETRAIN_DMD2, base + extra + ["--save", tmp_path / name, "--loss-trace", tmp_path / f"{name}.jsonl"],
               timeout=300).check(name)
    assert_traces_close(read_trace(tmp_path / "sliced.jsonl"), read_trace(tmp_path / "run.jsonl"), 0.0,
                        "two-expert teacher time-sliced vs resident", keys=DMD2_TRACE_KEYS)
    with world_of_one():
        student = load_payload(str(tmp_path / "run"), _one_process())
    names = [n for n in student["model"] if not n.endswith("_extra_state")]
    assert student["role"] == "student" and {n.split(".")[0] for n in names} == {"high", "low"}


def test_planner_counts_both_experts():
    from dmd2_mega.plan import memory_plan as mp
    info = {"latent_shape": [16, 21, 60, 104], "num_classes": None, "cond_shape": (512, 4096)}
    one, two = (mp.param_counts(mp.model_shape_from_info(s, info)) for s in ("wan2.1-14b", "wan2.2-a14b"))
    assert one["sharded"] + one["replicated"] == 14_288_491_584  # the meta-built Wan 2.1 14B (test_plan_memory)
    assert two["sharded"] + two["replicated"] == 2 * 14_288_491_584
    # time-sliced, the teacher keeps one expert resident while it runs (ExpertSleeper); all resident, both
    ms = mp.model_shape_from_info("wan2.2-a14b", info)
    from dmd2_mega.methods.dmd2.phases import PHASES
    plan = mp.plan_cycle(ms, PHASES, tp=8, dp=1, micro=1, steps=5, denoise=4, bf16=True, recompute=True)
    teacher = sum(plan.roles["teacher"].values())
    assert plan.phases[("critic", True)]["teacher"] == teacher // 2
    assert plan.phases[("critic", False)]["teacher"] == teacher
    assert mp.phase_bytes(plan, {"teacher"})["critic"] == plan.phases[("critic", False)]["total"] - teacher // 2


def test_time_sliced_teacher_keeps_one_expert_resident(pipeline):
    """ExpertSleeper: in a phase that needs the teacher, an expert wakes for its own forward after the other
    sleeps; outputs are those of the model without time-slicing; "none" frees both."""
    from dmd2_mega.methods.roles import Role
    from dmd2_mega.train.offload import ExpertSleeper, RoleAsleepError

    d, _ = pipeline
    g = torch.Generator().manual_seed(3)
    x, cond = torch.randn(3, 4, 3, 4, 6, generator=g), torch.randn(3, 5, 16, generator=g)
    with world_of_one():
        plain, sliced = load_model(str(d)), load_model(str(d))
        role = Role("teacher", sliced).with_offload(torch.device("cpu"))
        assert isinstance(role.sleeper, ExpertSleeper)
        one = sum(t.numel() * t.element_size() for t in [*sliced.high.parameters(), *sliced.high.buffers()])
        role.sleeper.set_resident("none")
        assert role.resident_bytes() == 0
        with pytest.raises(RoleAsleepError):
            sliced.high(x, torch.full((3,), 0.9), cond)
        role.sleeper.set_resident("all")  # needed: nothing is copied until a forward
        assert role.resident_bytes() == 0
        with torch.no_grad():
            for sigma, awake in ((torch.full((3,), 0.9), "high"), (torch.tensor([0.9, 0.2, 0.6]), "low"),
                                 (torch.full((3,), 0.1), "low")):
                assert torch.equal(sliced(x, sigma, cond), plain(x, sigma, cond))
                assert role.resident_bytes() == one  # one expert on the device
                assert getattr(sliced, awake).proj_out.weight.untyped_storage().size() > 0
        assert torch.equal(sliced.null_cond(2, "cpu"), plain.null_cond(2, "cpu"))
        role.sleeper.close()
