"""Nothing of a finished run is lost or silently changed by launch/convert_checkpoint.py (issue 50, items 5 and 9,
and the --save rule of its first bullet for conversions; `pretrained.check_save`, `pretrained._export`,
`models/wan/export.py`).

Checkpoints are built here without training: a tiny random WanPipeline folder converted into a teacher; a causal
init (the teacher's weights, its args recording --causal --causal-chunk-frames 2, as a Self-Forcing student's or a
causal init's do); a rank-4 LoRA student over that causal init (random adapters, its base's fingerprint, args naming
it as --student-load); a converted tiny SiT with a LoRA record.
  * a causal student's --to-diffusers and --to-diffusers --lora-only exports are refused in one line that says why
    and names launch/sample.py --stream and --allow-bidirectional-export; nothing is written;
  * with --allow-bidirectional-export, transformer/config.json records the chunking under `_dmd2_causal`,
    WanTransformer3DModel.from_pretrained still loads it (the same module as without the key), and the README says
    first that WanPipeline runs it with full attention;
  * a --lora-only export of adapters over the causal init names that init (by path), not the teacher; its README
    runs as written with the init's export as the base, and gives the merged student's transformer (<= 1e-5);
  * a DiT LoRA with --lora-only names flags that exist;
  * a conversion's --save that holds checkpoints is refused in one line naming --overwrite-save, byte for byte
    untouched (--from-diffusers and --merge-lora); --overwrite-save replaces it, says so, leaves nothing aside, and
    a failed write under it puts the old checkpoint back; --overwrite-save onto the LoRA base, or with an export,
    is one line.
Every case runs convert_checkpoint's main in process (`test_export_atomic.convert`).
"""
import json
import os
import re

import pytest
import torch

from dmd2_mega.train.checkpoint import iter_dir, rank_file, save_offline
from tests.test_export_atomic import LATENT, SIGMAS, _run_snippet, _tiny_pipeline, convert
from tests.utils import world_of_one

pytestmark = pytest.mark.timeout(300)
CHUNK = 2  # --causal-chunk-frames of the causal init


def _payload(root: str) -> dict:
    return torch.load(rank_file(iter_dir(root, int(open(os.path.join(root, "latest_checkpointed_iteration.txt"))
                                                     .read())), 0), weights_only=False)


def _tree(root) -> dict:
    """{relative path: bytes} of every file under `root`."""
    return {os.path.relpath(os.path.join(d, n), root): open(os.path.join(d, n), "rb").read()
            for d, _, names in os.walk(root) for n in names}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """{"base": pipeline folder, "teacher", "init": a causal student, "lora": adapters over init, "dit_lora"}."""
    from dmd2_mega.models.lora import adapt
    from dmd2_mega.pretrained import _one_process, import_diffusers, import_dit, load_model
    from dmd2_mega.train.lora_checkpoint import state_fingerprint
    from tests.test_dit_import import HEADS, official_state
    d = tmp_path_factory.mktemp("export_guards")
    with world_of_one():
        _tiny_pipeline(d / "base")
        import_diffusers(str(d / "base"), str(d / "teacher"), log=lambda *_: None)
        init = _payload(str(d / "teacher"))
        init["args"]["model"].update(causal=True, causal_chunk_frames=CHUNK, causal_local_attn_chunks=None,
                                     causal_sink_chunks=0, causal_context_noise=0.0)
        init.update(role="student", method="causal-init", student_sigmas=SIGMAS, iteration=3, data_info={
            "in_channels": LATENT[0], "latent_shape": LATENT, "num_classes": None, "cond_shape": (5, 16)})
        save_offline(str(d / "init"), 3, [init])
        model = load_model(str(d / "teacher"))  # rank-4 adapters, B moved off zero so that they count
        adapt(model, ("to_q", "to_v", "fc1"), 4, 8.0, seed=0)
        g = torch.Generator().manual_seed(3)
        adapters = {n: 0.1 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters() if ".lora." in n}
        lora = {**init, "model": adapters, "iteration": 5,
                "partition_dims": {n: None for n in adapters},
                "args": {**init["args"], "dmd2": {"teacher_load": str(d / "teacher"), "student_load": str(d / "init")}},
                "lora": {"rank": 4, "alpha": 8.0, "scale": 2.0, "targets": ["to_q", "to_v", "fc1"],
                         "base": str(d / "init"),
                         "fingerprint": state_fingerprint(init["model"], init["partition_dims"], _one_process())}}
        lora.update(method="Self-Forcing")
        save_offline(str(d / "lora"), 5, [lora])
        torch.save(official_state(), d / "sit.pt")
        import_dit(str(d / "sit.pt"), str(d / "sit"), parameterization="sit", num_heads=HEADS, log=lambda *_: None)
    dit = _payload(str(d / "sit"))
    dit.update(role="student", model={"blocks.0.attn.qkv.lora.A": torch.zeros(4, 32)},
               lora={"rank": 4, "alpha": 4, "scale": 1.0, "targets": ["qkv"], "base": str(d / "sit"),
                     "fingerprint": "x"})
    save_offline(str(d / "dit_lora"), 0, [dit])
    return {k: str(d / k) for k in ("base", "teacher", "init", "lora", "dit_lora")}


# ---- item 5: a causal student's export --------------------------------------------------------------------------

@pytest.mark.parametrize("which,more", [("init", []), ("lora", ["--lora-only"])], ids=["merged", "lora-only"])
def test_a_causal_students_export_is_refused_in_one_line(made, tmp_path, which, more):
    out = tmp_path / "export"
    rc, _, err = convert(["--load", made[which], "--to-diffusers", out, *more])
    assert rc == 1 and len(err) == 1, err
    assert f"--load {made[which]} is a causal student (chunks of {CHUNK} latent frames" in err[0], err
    assert "full attention" in err[0] and f"launch/sample.py --load {made[which]} --stream" in err[0], err
    assert "--allow-bidirectional-export" in err[0], err
    assert os.listdir(tmp_path) == []


def test_an_allowed_causal_export_records_its_chunking_and_says_how_it_runs(made, tmp_path):
    from diffusers import WanTransformer3DModel
    out, plain = tmp_path / "export", tmp_path / "plain"
    rc, printed, err = convert(["--load", made["init"], "--to-diffusers", out, "--allow-bidirectional-export"])
    assert rc == 0 and err == [], err
    assert "> --allow-bidirectional-export: " in printed and "not as it was trained" in printed, printed
    config = json.loads((out / "transformer" / "config.json").read_text())
    chunking = {k: v for k, v in config["_dmd2_causal"].items() if k != "note"}
    assert chunking == {"chunk_frames": CHUNK, "local_attn_chunks": None, "sink_chunks": 0, "context_noise": 0.0}
    rc, _, err = convert(["--load", made["teacher"], "--to-diffusers", plain])  # a bidirectional model: no key
    assert rc == 0 and "_dmd2_causal" not in json.loads((plain / "transformer" / "config.json").read_text())
    loaded = WanTransformer3DModel.from_pretrained(str(out), subfolder="transformer")
    ref = WanTransformer3DModel.from_pretrained(str(plain), subfolder="transformer")
    assert loaded.config.num_layers == ref.config.num_layers  # diffusers reads the config past the extra key
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), ref.state_dict().values()))
    readme = (out / "README.md").read_text()
    first = readme.split("```python")[0]
    assert "Not as trained" in first and "full attention" in first, first
    assert f"launch/sample.py --load {made['init']} --stream" in first and "_dmd2_causal" in first, first
    assert "# NOT as trained" in readme.split("```python")[1]


def test_lora_only_over_a_causal_init_names_the_init_and_its_readme_runs(made, tmp_path):
    from diffusers import WanTransformer3DModel
    lora, merged = tmp_path / "lora", tmp_path / "merged"
    rc, printed, err = convert(["--load", made["lora"], "--to-diffusers", lora, "--lora-only",
                                "--allow-bidirectional-export"])
    assert rc == 0 and err == [], err
    assert f"base the student init {made['init']}" in printed, printed
    readme = (lora / "README.md").read_text()
    assert "its adapters on the teacher" not in readme and "that teacher's transformer" not in readme, readme
    assert f"over the base {made['init']}: the student's init (--student-load), not the teacher" in readme
    command = re.search(r"#   python (launch/convert_checkpoint\.py .*)\n", readme).group(1)
    assert command.startswith(f"launch/convert_checkpoint.py --load {made['init']} --to-diffusers "
                              f"<the base export folder>")
    base_export = tmp_path / "init_export"  # the README's own command, as written
    rc, _, err = convert(command.replace("<the base export folder>", str(base_export)).split()[1:])
    assert rc == 0 and err == [], err
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert "Replace the three folder names" in readme
    code = (code.replace("<this folder>", str(lora)).replace("<the base Wan pipeline folder>", made["base"])
            .replace("<the base export folder>", str(base_export)))
    ns = _run_snippet(code)
    _, t, h, w = LATENT
    assert ns["video"].shape == ((t - 1) * 4 + 1, 8 * h, 8 * w, 3)
    rc, _, err = convert(["--load", made["lora"], "--to-diffusers", merged, "--allow-bidirectional-export"])
    assert rc == 0 and err == [], err
    g = torch.Generator().manual_seed(1)
    inputs = {"hidden_states": torch.randn(2, *LATENT, generator=g), "timestep": torch.tensor([300.0, 800.0]),
              "encoder_hidden_states": torch.randn(2, 5, 16, generator=g), "return_dict": False}
    with torch.no_grad():
        got = ns["pipe"].transformer.float()(**inputs)[0]
        want = WanTransformer3DModel.from_pretrained(str(merged), subfolder="transformer")(**inputs)[0]
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


# ---- item 9: a DiT LoRA with --lora-only -----------------------------------------------------------------------

def test_dit_lora_only_names_flags_that_exist(made, tmp_path):
    rc, _, err = convert(["--load", made["dit_lora"], "--to-diffusers", tmp_path / "x", "--lora-only"])
    assert rc == 1 and len(err) == 1, err
    assert "--to-diffusers-lora" not in err[0] and "diffusers-lora" not in err[0], err
    assert err[0] == (f"ConfigError: --lora-only: --load {made['dit_lora']} holds a DiT model; a diffusers LoRA file "
                      f"is written for a Wan model only (--merge-lora --save DIR merges its adapters into full "
                      f"weights)")
    assert os.listdir(tmp_path) == []


# ---- a conversion's --save ------------------------------------------------------------------------------------

def test_a_save_holding_checkpoints_is_refused_unless_overwrite_save(made, tmp_path):
    save = tmp_path / "teacher"
    rc, _, err = convert(["--from-diffusers", made["base"], "--save", save])
    assert rc == 0 and err == [], err
    before = _tree(save)
    for args in (["--from-diffusers", made["base"], "--tensor-model-parallel-size", "2"],
                 ["--load", made["lora"], "--merge-lora"]):
        rc, _, err = convert([*args, "--save", save])
        assert rc == 1 and err == [f"CheckpointError: --save {save} holds checkpoints up to iteration 0; this "
                                   f"conversion would write over them. Choose another --save, or give "
                                   f"--overwrite-save to replace them (nothing was written)"], err
        assert _tree(save) == before and sorted(os.listdir(tmp_path)) == ["teacher"]
    rc, printed, err = convert(["--from-diffusers", made["base"], "--save", save, "--tensor-model-parallel-size", "2",
                                "--overwrite-save"])
    assert rc == 0 and err == [], err
    assert (f"> --overwrite-save: --save {save} holds checkpoints up to iteration 0 of another run; this run writes "
            f"over them") in printed, printed
    assert sorted(os.listdir(tmp_path)) == ["teacher"]  # nothing left aside
    assert sorted(os.listdir(save / "iter_0000000")) == ["mp_rank_00", "mp_rank_01"]  # the TP=2 conversion


def test_a_failed_overwrite_puts_the_old_checkpoint_back(made, tmp_path, monkeypatch):
    from dmd2_mega.train import checkpoint
    save = tmp_path / "teacher"
    rc, _, err = convert(["--from-diffusers", made["base"], "--save", save])
    assert rc == 0
    before = _tree(save)

    def full(*_, **__):
        raise OSError(28, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(checkpoint.torch, "save", full)
        rc, _, err = convert(["--load", made["lora"], "--merge-lora", "--save", save, "--overwrite-save"])
    assert rc == 1 and len(err) == 1 and "No space left on device" in err[0], err
    assert sorted(os.listdir(tmp_path)) == ["teacher"] and _tree(save) == before


def test_overwrite_save_where_it_does_not_apply_is_one_line(made, tmp_path):
    rc, _, err = convert(["--load", made["lora"], "--merge-lora", "--save", made["init"], "--overwrite-save"])
    assert rc == 1 and err == [f"ConfigError: --overwrite-save: --save {made['init']} is the base of --load "
                               f"{made['lora']}'s adapters; replacing it would leave them without their base. "
                               f"Choose another --save (nothing was written)"], err
    assert os.path.isfile(os.path.join(made["init"], "latest_checkpointed_iteration.txt"))
    rc, _, err = convert(["--load", made["teacher"], "--to-diffusers", tmp_path / "x", "--overwrite-save"])
    assert rc == 1 and len(err) == 1 and "--overwrite-save replaces what --save holds" in err[0], err
    assert os.listdir(tmp_path) == []
