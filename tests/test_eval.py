"""Digits metric: Frechet distance vs closed forms, cached classifier, evaluate_digits, CLI, grid."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import scipy.linalg
import torch
from PIL import Image

from dmd2_mega.errors import EvalInputError
from dmd2_mega.eval.classifier import CACHE_ENV, CACHE_NAME, load_or_train_classifier, load_split
from dmd2_mega.eval.digits import evaluate_digits
from dmd2_mega.eval.frechet import frechet_distance
from dmd2_mega.eval.grid import save_grid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- Frechet distance
def _exact_moments(mu, std, n=8):
    """n rows whose sample mean is mu and unbiased covariance is exactly diag(std^2)."""
    h = scipy.linalg.hadamard(n)[:, 1:1 + len(mu)].astype(np.float64)  # orthogonal, zero-mean columns
    return mu + h * np.sqrt((n - 1) / n) * std


@pytest.mark.parametrize("d", [1, 3, 7])
def test_frechet_closed_form_diagonal(d):
    rng = np.random.default_rng(d)
    mu1, mu2 = rng.normal(size=d), rng.normal(size=d)
    s1, s2 = rng.uniform(0.1, 2, d), rng.uniform(0.1, 2, d)
    a, b = _exact_moments(mu1, s1), _exact_moments(mu2, s2)
    assert np.allclose(np.cov(a, rowvar=False), np.diag(s1 ** 2))  # the construction itself
    expected = np.sum((mu1 - mu2) ** 2) + np.sum((s1 - s2) ** 2)
    assert frechet_distance(a, b) == pytest.approx(expected, rel=1e-10, abs=1e-12)
    assert frechet_distance(torch.from_numpy(a).float(), b) == pytest.approx(expected, rel=1e-5)


def test_frechet_full_cov_vs_scipy_sqrtm():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(50, 6)) @ rng.normal(size=(6, 6))
    b = rng.normal(size=(40, 6)) @ rng.normal(size=(6, 6)) + 0.5
    s1, s2 = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    ref = (np.sum((a.mean(0) - b.mean(0)) ** 2) + np.trace(s1) + np.trace(s2)
           - 2 * np.trace(scipy.linalg.sqrtm(s1 @ s2).real))
    assert frechet_distance(a, b) == pytest.approx(ref, rel=1e-8)
    assert frechet_distance(b, a) == pytest.approx(ref, rel=1e-8)


def test_frechet_self_shift_and_singular():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, 20))  # N < D: singular covariance
    assert frechet_distance(x, x) == pytest.approx(0.0, abs=1e-9)
    assert frechet_distance(x, x[::-1]) == pytest.approx(0.0, abs=1e-9)
    shift = rng.normal(size=20)
    assert frechet_distance(x, x + shift) == pytest.approx(shift @ shift, rel=1e-8)
    with pytest.raises(EvalInputError, match="feature dims"):
        frechet_distance(x, x[:, :3])
    with pytest.raises(EvalInputError, match="NaN"):
        frechet_distance(np.full((3, 2), np.nan), x[:, :2])


# ---------------------------------------------------------------- classifier + metric
@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh cache dir via $DMD2_MEGA_CACHE: the first evaluate call trains and writes it."""
    d = tmp_path_factory.mktemp("dmd2_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(d))
        yield d


@pytest.fixture(scope="module")
def heldout():
    return load_split("heldout")


def test_real_heldout_digits(cache, heldout):
    x, y = heldout
    r = evaluate_digits(x, y)
    assert (cache / CACHE_NAME).is_file()
    assert r["classifier_heldout_accuracy"] >= 0.97
    assert r["class_accuracy"] == pytest.approx(r["classifier_heldout_accuracy"])
    assert r["num_samples"] == len(x)
    assert r["frechet_distance"] < 1e-6 * r["frechet_floor"]  # identical to the reference set
    assert r["fd_ratio"] < 1e-6 and r["frechet_floor"] > 0
    # labels permuted so none matches: accuracy collapses, FD unchanged
    wrong = (y + 1 + torch.randint(0, 9, y.shape, generator=torch.Generator().manual_seed(0))) % 10
    assert evaluate_digits(x, wrong)["class_accuracy"] < 0.05
    assert evaluate_digits(x, None)["class_accuracy"] is None


def test_other_real_digits_score_near_floor(cache):
    x, y = load_split("train")
    idx = torch.randperm(len(x), generator=torch.Generator().manual_seed(123))[:300]
    r = evaluate_digits(x[idx], y[idx])
    assert 0.5 < r["fd_ratio"] < 2.0, r
    assert r["class_accuracy"] >= 0.97


def test_noise_scores_badly(cache, heldout):
    _, y = heldout
    noise = torch.rand((len(y), 1, 8, 8), generator=torch.Generator().manual_seed(0)) * 2 - 1
    r = evaluate_digits(noise, y)
    assert r["fd_ratio"] > 20, r
    assert r["class_accuracy"] < 0.3


def test_cache_reload_and_corrupt_retrain(cache, heldout, capfd):
    evaluate_digits(heldout[0][:10])  # make sure the cache was written
    file = cache / CACHE_NAME
    first = load_or_train_classifier()
    assert "training" not in capfd.readouterr().err  # loaded, not retrained
    assert first.accuracy(*heldout) >= 0.97
    file.write_bytes(b"not a checkpoint")
    again = load_or_train_classifier()
    assert "retraining" in capfd.readouterr().err
    for k, v in first.state_dict().items():  # training is deterministic
        assert torch.equal(v, again.state_dict()[k]), k
    assert file.stat().st_size > 1000 and not list(cache.glob("*.tmp"))


def test_input_validation(cache, heldout):
    x, y = heldout
    with pytest.raises(EvalInputError, match=r"\[N, 1, 8, 8\]"):
        evaluate_digits(x[:, :, :4])
    with pytest.raises(EvalInputError, match="NaN"):
        evaluate_digits(torch.where(x == x.max(), float("nan"), x))
    with pytest.raises(EvalInputError, match=r"\[-1, 1\]"):
        evaluate_digits((x + 1) * 127.5)
    with pytest.raises(EvalInputError, match="labels must lie"):
        evaluate_digits(x, torch.full_like(y, 10))
    with pytest.raises(EvalInputError, match="shape"):
        evaluate_digits(x, y[:-1])


@pytest.mark.integration
def test_cli_prints_json(cache, heldout, tmp_path):
    x, y = heldout
    f = tmp_path / "samples.npz"
    np.savez(f, images=x[:100].numpy(), labels=y[:100].numpy())
    env = {**os.environ, CACHE_ENV: str(cache), "TORCH_COMPILE_DISABLE": "1"}
    out = subprocess.run([sys.executable, "-m", "dmd2_mega.eval.digits", str(f)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    ref = evaluate_digits(x[:100], y[:100])
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k] == pytest.approx(ref[k], rel=1e-6)

    np.savez(f, images=x[:100].numpy())
    out = subprocess.run([sys.executable, "-m", "dmd2_mega.eval.digits", str(f)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "labels" in out.stderr and out.stdout == ""



def test_report_table_json_and_one_line_errors(cache, heldout, tmp_path, capsys):
    """eval.report (the quickstart's table, through report.report_main like report_video): one row per NAME=PATH,
    --json with every metric; a malformed pair, a file without labels, labels out of range: one line, status 2."""
    from dmd2_mega.eval import report
    x, y = heldout
    np.savez(tmp_path / "real.npz", images=x[:100].numpy(), labels=y[:100].numpy())
    js = tmp_path / "out" / "metrics.json"
    assert report.main([f"real, held out={tmp_path / 'real.npz'}", "--json", str(js)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| model | Frechet distance (floor ") and table[2].startswith("| real, held out | ")
    got = json.loads(js.read_text())["real, held out"]
    assert got["frechet_distance"] == pytest.approx(evaluate_digits(x[:100], y[:100])["frechet_distance"], rel=1e-9)
    # one model at several seeds ("LABEL @ seed S"): a second table of the mean, sd and per-seed distances
    halves = [tmp_path / "a.npz", tmp_path / "b.npz", tmp_path / "c.npz"]
    for k, path in enumerate(halves):
        np.savez(path, images=x[100 * k:100 * k + 100].numpy(), labels=y[100 * k:100 * k + 100].numpy())
    assert report.main([f"s @ seed {k + 1}={path}" for k, path in enumerate(halves)] + ["t @ seed 1=" + str(halves[0]),
                                                                                          "--json", str(js)]) == 0
    table = capsys.readouterr().out.split("\n\n")
    fds = [evaluate_digits(x[100 * k:100 * k + 100], y[100 * k:100 * k + 100])["frechet_distance"] for k in range(3)]
    assert len(table) == 2 and len(table[1].splitlines()) == 3, table  # one label with two seeds or more: "s"
    mean_row = table[1].splitlines()[2]
    want = (f"| s | 3 | {np.mean(fds):.3f} +- {np.std(fds, ddof=1):.3f} "
            f"(1: {fds[0]:.3f}, 2: {fds[1]:.3f}, 3: {fds[2]:.3f})")
    assert mean_row.startswith(want), (mean_row, want)
    assert set(json.loads(js.read_text())) == {"s @ seed 1", "s @ seed 2", "s @ seed 3", "t @ seed 1"}
    np.savez(tmp_path / "nolabels.npz", images=x[:100].numpy())
    np.savez(tmp_path / "null.npz", images=x[:100].numpy(), labels=np.full(100, 10))
    for pair, needle in (("no-equals-sign", "expected NAME=PATH, got 'no-equals-sign'"),
                         (f"a={tmp_path / 'nolabels.npz'}", "nolabels.npz: missing key(s) ['labels']"),
                         (f"a={tmp_path / 'null.npz'}", "null.npz: labels must lie in [0, 10) (no null class)")):
        assert report.main([pair]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("error: ") and needle in err and err.count("\n") == 1, err


# ---------------------------------------------------------------- grid
def test_grid_rows_per_class(tmp_path):
    labels = torch.tensor([0, 2, 2, 1, 0, 2, 5])
    vals = torch.linspace(-1, 1, len(labels))  # image i is constant vals[i]
    images = vals.view(-1, 1, 1, 1).expand(-1, 1, 8, 8)
    p = save_grid(images, labels, tmp_path / "sub" / "g.png", upscale=3)
    im = Image.open(p)
    assert im.mode == "L" and im.size == (3 * 8 * 3, 6 * 8 * 3)  # cols = 3 (class 2), rows = 6
    a = np.asarray(im)
    cell = lambda r, c: a[r * 24:(r + 1) * 24, c * 24:(c + 1) * 24]  # noqa: E731
    expect = np.round((vals.numpy() + 1) * 127.5)
    for (r, c), i in {(0, 0): 0, (0, 1): 4, (2, 0): 1, (2, 1): 2, (2, 2): 5, (1, 0): 3, (5, 0): 6}.items():
        assert (cell(r, c) == expect[i]).all(), (r, c)
    assert (cell(3, 0) == 0).all() and (cell(0, 2) == 0).all()  # empty cells stay black
    assert not list((tmp_path / "sub").glob("*.tmp"))


def test_grid_rgb_other_channels_and_unlabelled(tmp_path):
    rgb = torch.rand(5, 3, 4, 6) * 2 - 1
    im = Image.open(save_grid(rgb, None, tmp_path / "rgb.png", upscale=2))
    assert im.mode == "RGB" and im.size == (3 * 6 * 2, 2 * 4 * 2)  # ceil(sqrt 5) = 3 cols, 2 rows
    two = torch.rand(4, 2, 8, 8) * 2 - 1
    im = Image.open(save_grid(two, torch.tensor([1, 1, 0, 3]), tmp_path / "c2.png", num_classes=10))
    assert im.mode == "L" and im.size == (2 * 32, 10 * 32)
    assert np.asarray(im)[0:4, 0:4].max() == np.round((two[2, 0, 0, 0].item() + 1) * 127.5)
    with pytest.raises(EvalInputError, match="labels must lie"):
        save_grid(two, torch.tensor([0, 1, 2, 10]), tmp_path / "bad.png", num_classes=10)


def test_diversity_is_one_on_real_and_zero_under_collapse(cache, heldout):
    from dmd2_mega.eval.digits import pixel_diversity
    x, y = heldout
    assert pixel_diversity(x, y) > 0.1  # the raw within-class pixel std of real digits
    # the reported metric is relative to the held-out set: exactly one on it, with or without labels
    assert evaluate_digits(x, y)["diversity"] == pytest.approx(1.0, rel=1e-12)
    assert evaluate_digits(x, None)["diversity"] == pytest.approx(1.0, rel=1e-12)
    collapsed = torch.stack([x[(y == int(c)).nonzero()[0, 0]] for c in y])  # one image per class
    assert pixel_diversity(collapsed, y) == 0.0
    assert evaluate_digits(collapsed, y)["diversity"] == 0.0
    # closed form on a toy: class 0 pixels {0, 2} -> std sqrt(2); class 1 constant -> 0
    toy = torch.tensor([[0.0], [2.0], [5.0], [5.0]]).view(4, 1, 1, 1)
    assert abs(pixel_diversity(toy, torch.tensor([0, 0, 1, 1])) - 2 ** 0.5 / 2) < 1e-12
