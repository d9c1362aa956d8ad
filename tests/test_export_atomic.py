"""Exports and conversions are all or nothing, and the exported folder tells the user how to run it (issue 27,
items 4 and 10).

A tiny Wan pipeline folder is built here (a random 2-layer WanTransformer3DModel, a tiny AutoencoderKLWan, a
1-layer UMT5 with a word-level tokenizer, saved by WanPipeline.save_pretrained); its transformer is converted
into a teacher, and a "student" is that teacher's checkpoint with a shifted 3-step grid and the data shape it was
trained on (latents [4, 3, 2, 4]).
  * a write that fails after transformer/ is written (a full disk: OSError, RuntimeError as torch's zip writer
    raises it) is ONE line and leaves nothing at --to-diffusers / --save (no config.json of a failed import);
    the rerun works;
  * a SIGKILL after transformer/ is written leaves no --to-diffusers folder; the next run removes the leftover
    temporary with a line saying so and completes;
  * `staging.staged_output` for a file and a folder: a second writer on the same path is refused while the
    first holds it; a folder at the temporary name that is not ours is refused, never deleted;
  * README.md's snippet, run as written (paths substituted) on CPU: the trained frame count and size, the
    student's own sigmas, and the same video twice under torch.manual_seed;
  * the README's seed recipe in diffusers' own WanPipeline (issue 53 item 3): the same seed is the same video after
    other draws, another seed another video, and generator= alone does not repeat one (the scheduler's re-noise
    between steps draws from torch's global RNG: WanPipeline passes no generator to scheduler.step).
"""
import contextlib
import io
import json
import os
import re
import shutil
import signal
import sys
import warnings

import numpy as np
import pytest
import torch

from dmd2_mega.train.checkpoint import iter_dir, rank_file, save_offline
from dmd2_mega.errors import CheckpointError, ConfigError
from dmd2_mega.flow import student_sigmas
from dmd2_mega.models import get_spec
from dmd2_mega.train.resilience import run_main
from launch.convert_checkpoint import main as convert_main, parse_args
from tests.utils import run, tiny_wan_pipeline_parts, tiny_wan_transformer, world_of_one

pytestmark = pytest.mark.timeout(300)
LATENT = [4, 3, 2, 4]  # [C, T, H, W] the student was "trained" on: 9 frames of 16 x 32 with the tiny VAE (4x, 8x)
SIGMAS = student_sigmas(3, shift=3.0).tolist()  # shifted: diffusers' own 3-step grid is not this one


@pytest.fixture(scope="module")
def world():
    with world_of_one() as ps:
        yield ps


def _tiny_pipeline(folder) -> None:
    """A WanPipeline folder of tiny random models (nothing downloaded)."""
    from diffusers import WanPipeline
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        WanPipeline(transformer=tiny_wan_transformer(0), **tiny_wan_pipeline_parts()).save_pretrained(folder)


@pytest.fixture(scope="module")
def made(world, tmp_path_factory):
    """{"base": the pipeline folder, "teacher": its transformer converted, "student": a student checkpoint}."""
    from dmd2_mega.pretrained import import_diffusers
    d = tmp_path_factory.mktemp("export_atomic")
    _tiny_pipeline(d / "base")
    import_diffusers(str(d / "base"), str(d / "teacher"), log=lambda *_: None)
    payload = torch.load(rank_file(iter_dir(str(d / "teacher"), 0), 0), weights_only=False)
    payload.update(student_sigmas=SIGMAS, iteration=7, data_info={
        "in_channels": LATENT[0], "latent_shape": LATENT, "num_classes": None, "cond_shape": (5, 16)})
    save_offline(str(d / "student"), 7, [payload])
    with open(d / "student" / "config.json", "w") as f:
        json.dump(get_spec("wan-debug").diffusers_config(), f)
    return {k: str(d / k) for k in ("base", "teacher", "student")}


def convert(args) -> tuple:
    """`launch/convert_checkpoint.py args` in process, as its __main__ runs it: (exit status, stdout, stderr lines)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = run_main(lambda: convert_main(parse_args([str(a) for a in args])))
    return rc, out.getvalue(), [ln for ln in err.getvalue().splitlines() if ln.strip()]


def no_space(*_, **__):
    raise OSError(28, "No space left on device")


def zip_writer_full(*_, **__):  # what torch.save raises on a full disk
    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 87232 vs 87120")


def test_failed_export_leaves_nothing_and_the_rerun_works(made, tmp_path, monkeypatch):
    from dmd2_mega.models.wan import export
    out = tmp_path / "export"
    with monkeypatch.context() as m:  # the disk fills after transformer/ is written
        m.setattr(export, "write_scheduler", no_space)
        rc, _, err = convert(["--load", made["student"], "--to-diffusers", out])
    assert rc == 1 and len(err) == 1, err
    assert err[0].startswith("CheckpointError: writing --to-diffusers") and "No space left on device" in err[0]
    assert sorted(os.listdir(tmp_path)) == []  # no folder, no temporary
    rc, printed, err = convert(["--load", made["student"], "--to-diffusers", out])
    assert rc == 0 and err == [], err
    assert sorted(os.listdir(out)) == ["README.md", "scheduler", "transformer"]
    assert sorted(os.listdir(tmp_path)) == ["export"]
    rc, _, err = convert(["--load", made["student"], "--to-diffusers", out])  # never over a finished export
    assert rc == 1 and err == [f"ConfigError: --to-diffusers {out} exists and is not empty; export into a new "
                               f"directory (nothing was written)"]


def test_failed_import_leaves_no_config_json(made, tmp_path, monkeypatch):
    from dmd2_mega.train import checkpoint
    save = tmp_path / "teacher"
    for failure in (no_space, zip_writer_full):
        with monkeypatch.context() as m:
            m.setattr(checkpoint.torch, "save", failure)
            rc, _, err = convert(["--from-diffusers", made["base"], "--save", save])
        assert rc == 1 and len(err) == 1 and err[0].startswith("CheckpointError: writing ") and str(save) in err[0]
        assert ".partial" not in err[0], err  # names --save, not the temporary folder
        assert os.listdir(tmp_path) == []  # no config.json, no iter_0000000.tmp/, no temporary
    rc, _, err = convert(["--from-diffusers", made["base"], "--save", save])
    assert rc == 0 and err == []
    assert sorted(os.listdir(save)) == ["config.json", "iter_0000000", "latest_checkpointed_iteration.txt"]
    written = (save / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt").read_bytes()
    assert str(save).encode() in written and b".partial" not in written  # records --save, not the temporary


KILLED_EXPORT = """
import os, signal, sys
from dmd2_mega import pretrained
from dmd2_mega.models.wan import export
def killed(*args, **kwargs):  # SIGKILL once transformer/ is written
    assert os.path.isfile(os.path.join(pretrained_out(), "transformer", "config.json"))
    os.kill(os.getpid(), signal.SIGKILL)
def pretrained_out():
    return next(os.path.join(r, d) for r, ds, _ in os.walk(os.path.dirname(sys.argv[2])) for d in ds
                if os.path.isdir(os.path.join(r, d, "transformer")))
export.write_scheduler = killed
pretrained.export_diffusers(sys.argv[1], sys.argv[2])
"""


@pytest.mark.integration
def test_killed_export_is_removed_by_the_next_run(made, tmp_path):
    out = tmp_path / "export"
    r = run([sys.executable, "-c", KILLED_EXPORT, made["student"], out])
    assert r.returncode == -signal.SIGKILL, r.tail()
    assert not os.path.exists(out)  # nothing that diffusers would load as a finished export
    assert os.listdir(tmp_path) == ["export.partial"]
    rc, printed, err = convert(["--load", made["student"], "--to-diffusers", out])
    assert rc == 0 and err == [], err
    assert f"> removed {out}.partial, left by an earlier --to-diffusers {out} that did not finish" in printed
    assert sorted(os.listdir(tmp_path)) == ["export"]
    assert sorted(os.listdir(out)) == ["README.md", "scheduler", "transformer"]


def _snippet(readme: str, folder: str, base: str) -> str:
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert code.count("<this folder>") >= 2 and code.count("<the base Wan pipeline folder>") == 1, code
    return code.replace("<this folder>", folder).replace("<the base Wan pipeline folder>", base)


def _run_snippet(code: str) -> dict:
    ns = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, "README.md", "exec"), ns)
    return ns


def test_readme_snippet_runs_as_written_at_the_trained_size_and_sigmas(made, tmp_path):
    out = tmp_path / "export"
    rc, _, err = convert(["--load", made["student"], "--to-diffusers", out])
    assert rc == 0 and err == [], err
    readme = (out / "README.md").read_text()
    assert '.to("cuda")' not in readme and "torch.bfloat16)" not in readme  # the device and dtype are picked
    code = _snippet(readme, str(out), made["base"])
    first, second = _run_snippet(code), _run_snippet(code)
    _, t, h, w = LATENT
    assert first["video"].shape == ((t - 1) * 4 + 1, 8 * h, 8 * w, 3)  # not WanPipeline's 81 x 480 x 832
    assert first["pipe"].scheduler.sigmas.tolist() == pytest.approx(SIGMAS + [0.0], abs=1e-6)
    np.testing.assert_array_equal(first["video"], second["video"])  # torch.manual_seed makes it repeatable
    unpinned = _run_snippet("\n".join(ln for ln in code.splitlines() if "set_timesteps = functools" not in ln))
    assert unpinned["pipe"].scheduler.sigmas[:-1].tolist() != pytest.approx(SIGMAS, abs=1e-3)  # the pin is needed


def test_the_readmes_seed_repeats_a_video_and_generator_alone_does_not(made, tmp_path):
    """Issue 53 item 3: the student's sampler re-noises between steps (the exported scheduler's
    stochastic_sampling), and WanPipeline calls scheduler.step without its generator, so that noise comes from
    torch's global RNG; no diffusers scheduler that re-noises can be handed the pipeline's generator, and an
    ODE scheduler is not the student's sampler. The README's recipe, torch.manual_seed right before the call,
    gives the same video twice (bit-exact: the same draws and arithmetic) even after other draws, and another seed
    another video; `generator=` alone fixes only the starting noise, as the README says."""
    out = tmp_path / "export"
    rc, _, err = convert(["--load", made["student"], "--to-diffusers", out])
    assert rc == 0 and err == [], err
    code = _snippet((out / "README.md").read_text(), str(out), made["base"])
    assert code.count("torch.manual_seed(0)\n") == 1, code
    build, call = code.split("torch.manual_seed(0)\n")
    assert call.startswith("video = pipe(") and call.count("\n") == 1, call  # the seed is the line before the call
    ns = _run_snippet(build)
    ns["pipe"].set_progress_bar_config(disable=True)

    def video(seed: int, generator_seed=None) -> np.ndarray:
        """The README's call after torch.manual_seed(seed), with generator=<a generator of generator_seed>."""
        torch.manual_seed(seed)
        given = call if generator_seed is None else call.replace(
            "pipe(", f"pipe(generator=torch.Generator().manual_seed({generator_seed}), ", 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exec(compile(given, "README.md", "exec"), ns)
        return ns["video"]

    first, other, again = video(0), video(1), video(0)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other), "another torch.manual_seed gave the same video: the test cannot fail"
    assert not np.array_equal(video(1, generator_seed=0), video(2, generator_seed=0)), (
        "generator= alone now repeats the video: WanPipeline hands it to scheduler.step, so the README "
        "(dmd2_mega/models/wan/export.py, readme) can offer generator= in place of torch.manual_seed")


@pytest.mark.parametrize("folder", [True, False], ids=["folder", "file"])
def test_staged_output_refuses_a_second_writer_and_a_foreign_temporary(tmp_path, folder):
    import fcntl
    from dmd2_mega.files.dir_lock import LOCK_NAME
    from dmd2_mega.files.staging import staged_output
    out = tmp_path / ("export" if folder else "export.pt")
    staging = tmp_path / (out.name + ".partial")
    staging.mkdir()
    fd = os.open(staging / LOCK_NAME, os.O_RDWR | os.O_CREAT)  # another writer, mid-export
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, json.dumps({"host": "h", "pid": 4242, "start": 0}).encode())
        (staging / "half-written").write_text("theirs")
        with pytest.raises(CheckpointError, match=r"in use by another run \(host h, pid 4242"):
            with staged_output(str(out), "--to-x", folder, "export elsewhere"):
                pytest.fail("wrote while another writer holds the path")
        assert (staging / "half-written").read_text() == "theirs" and not out.exists()
    finally:
        os.close(fd)
    os.unlink(staging / LOCK_NAME)  # now a folder at the temporary name that dmd2-mega did not make
    with pytest.raises(ConfigError, match=r"exists and was not made by dmd2-mega"):
        with staged_output(str(out), "--to-x", folder, "export elsewhere"):
            pytest.fail("wrote over a foreign temporary")
    assert (staging / "half-written").read_text() == "theirs" and not out.exists()
    shutil.rmtree(staging)
    with staged_output(str(out), "--to-x", folder, "export elsewhere") as where:
        if folder:
            open(os.path.join(where, "a"), "w").write("ours")
        else:
            open(where, "w").write("ours")
    assert (out / "a" if folder else out).read_text() == "ours" and sorted(os.listdir(tmp_path)) == [out.name]


def test_staged_output_names_the_full_disk_under_a_writers_wrapper(tmp_path):
    """torch's zip writer raises RuntimeError('... unexpected pos A vs B') with the ENOSPC OSError as its context:
    the one line names the full disk (as the checkpoint saves do), not the wrapper."""
    from dmd2_mega.files.staging import staged_output
    out = tmp_path / "export.pt"
    with pytest.raises(CheckpointError, match=r"^writing --to-official .*export\.pt failed: No space left on device; "
                                              r"nothing was kept at"):
        with staged_output(str(out), "--to-official", False, "export to a new file"):
            try:
                raise OSError(28, "No space left on device")
            except OSError:
                zip_writer_full()
    assert os.listdir(tmp_path) == []
