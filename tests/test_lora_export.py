"""A LoRA student exported for diffusers (issue 31 item 4; `models/wan/export.export_lora`, convert_checkpoint.py
--to-diffusers [--lora-only]).

A tiny Wan pipeline folder (tests/test_export_atomic.py's: random 2-layer transformer, tiny VAE and UMT5) is
converted into a teacher; a LoRA student (rank 4, alpha 8) is distilled from it for 2 cycles on random latents.
  * --lora-only writes the adapters that WanPipeline.load_lora_weights (diffusers + PEFT) puts on the base
    pipeline's own transformer: its output equals the merged export's WanTransformer3DModel (<= 1e-5) and differs
    from the bare base (the adapters count);
  * the merged export (--to-diffusers alone) loads with from_pretrained;
  * the LoRA README snippet runs as written on CPU for the student's steps at its trained size;
  * --lora-only on full weights is one line.
"""
import os
import warnings

import pytest
import torch

from dmd2_mega.data import write_shards
from tests.test_export_atomic import LATENT, _run_snippet, _snippet, _tiny_pipeline, convert
from tests.utils import world_of_one

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from dmd2_mega.pretrained import import_diffusers
    from launch import pretrain_dmd2
    d = tmp_path_factory.mktemp("lora_export")
    with world_of_one():
        _tiny_pipeline(d / "base")
        import_diffusers(str(d / "base"), str(d / "teacher"), log=lambda *_: None)
    g = torch.Generator().manual_seed(0)
    write_shards(str(d / "data"), torch.randn(8, *LATENT, generator=g), cond=torch.randn(8, 5, 16, generator=g),
                 shard_size=8, negative=torch.randn(5, 16, generator=g))
    with world_of_one():
        assert pretrain_dmd2.main(["--model-size", str(d / "teacher"), "--data", str(d / "data"),
                                   "--teacher-load", str(d / "teacher"), "--student-lora-rank", "4",
                                   "--critic-lora-rank", "4", "--lora-alpha", "8", "--micro-batch-size", "2",
                                   "--global-batch-size", "2", "--dmd2-critic-steps-per-rollout", "1",
                                   "--dmd2-denoising-steps", "3", "--lr", "2e-2", "--train-iters", "2",
                                   "--save", str(d / "student")]) == 0
    return {k: str(d / k) for k in ("base", "teacher", "student")}


def transformer_inputs():
    g = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(2, *LATENT, generator=g), "timestep": torch.tensor([300.0, 800.0]),
            "encoder_hidden_states": torch.randn(2, 5, 16, generator=g), "return_dict": False}


def test_the_lora_file_on_the_base_pipeline_is_the_merged_student(made, tmp_path):
    from diffusers import WanPipeline, WanTransformer3DModel
    lora, merged = tmp_path / "lora", tmp_path / "merged"
    rc, printed, err = convert(["--load", made["student"], "--to-diffusers", lora, "--lora-only"])
    assert rc == 0 and err == [], err
    assert sorted(os.listdir(lora)) == ["README.md", "pytorch_lora_weights.safetensors", "scheduler"]
    assert "rank 4 alpha 8 on 20 linears" in printed, printed
    rc, _, err = convert(["--load", made["student"], "--to-diffusers", merged])
    assert rc == 0 and err == [], err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = WanPipeline.from_pretrained(made["base"])
        bare = pipe.transformer(**transformer_inputs())[0]
        pipe.load_lora_weights(str(lora))
        want = WanTransformer3DModel.from_pretrained(str(merged), subfolder="transformer")(**transformer_inputs())[0]
    with torch.no_grad():
        got = pipe.transformer(**transformer_inputs())[0]
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 1e-5 * scale
    assert float((bare - want).abs().max()) > 1e-3 * scale  # the adapters moved the student off its base


def test_the_lora_readme_runs_as_written_for_the_students_steps(made, tmp_path):
    out = tmp_path / "lora"
    rc, _, err = convert(["--load", made["student"], "--to-diffusers", out, "--lora-only", "--no-ema"])
    assert rc == 0 and err == [], err
    readme = (out / "README.md").read_text()
    assert "pipe.load_lora_weights(" in readme and "WanTransformer3DModel.from_pretrained" not in readme
    ns = _run_snippet(_snippet(readme, str(out), made["base"]))
    _, t, h, w = LATENT
    assert ns["video"].shape == ((t - 1) * 4 + 1, 8 * h, 8 * w, 3)
    assert len(ns["pipe"].scheduler.sigmas) == 4  # the student's 3 steps and the final 0


def test_lora_only_on_full_weights_is_one_line(made, tmp_path):
    rc, _, err = convert(["--load", made["teacher"], "--to-diffusers", tmp_path / "x", "--lora-only"])
    assert rc == 1 and len(err) == 1 and "holds full weights, not LoRA adapters" in err[0], err
    assert not (tmp_path / "x").exists()
