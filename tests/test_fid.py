"""FID (`dmd2_mega/eval/fid.py`, `dmd2_mega/eval/inception.py`, `launch/eval_fid.py`) on CPU.

  a. Streaming statistics: features built so that their sample means and covariances are known exactly
     (C_a = R diag(l_a) R^T, C_b = R diag(l_b) R^T with one rotation R), fed in uneven batches to several
     partial `FeatureStats` ("ranks") and merged: mu / Sigma equal the construction and the FID equals the
     closed form ||mu_a - mu_b||^2 + sum_k (sqrt(l_a,k) - sqrt(l_b,k))^2, float64.
  b. Pixels -> uint8 (round half up / floor, grey -> 3 channels, NaN -> 0); per-sample keyed noise; the
     statistics of a batched, sharded stream equal np.mean / np.cov of all features at once.
  c. End to end with a tiny random TorchScript "Inception" (same call convention as inception-2015-12-05.pt:
     forward(img, return_features=False), resizing inside) and synthetic reference statistics: the debug teacher
     (Euler + CFG) at 1 rank (in-process, batch 4) and 2 ranks (torchrun, gloo, batch 3) give the same
     statistics and FID; the printed FID equals the one recomputed with scipy's sqrtm from --save-stats; the
     statistics equal those of all samples regenerated at once. A DMD2 student (the teacher's payload with
     "student_sigmas" and an EMA) samples its own grid with its EMA weights, or raw weights with --no-ema.
     Latents are decoded by --vae (a tiny AutoencoderKL) before the network, and refused without it.
  d. Mistakes are one line naming the file: a missing --inception-weights (and where it comes from), a state dict
     instead of TorchScript, reference stats without 'mu' / 'sigma' or of another width, pixels with --vae.
"""
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import scipy.linalg
import torch
import torch.nn.functional as F

from dmd2_mega.train.checkpoint import iter_dir, latest_iteration, load_payload, rank_file, save_offline
from dmd2_mega.eval.fid import FeatureStats, pixels_to_uint8, shard_indices, stats_problem, stream_stats
from dmd2_mega.eval.frechet import gaussian_frechet
from dmd2_mega.sampling import checkpoint_sampler, keyed_noise, load_sampling_model
from launch import eval_fid
from tests.test_media import kl_latent_teacher
from tests.utils import REPO, torchrun, world_of_one

INTEGRATION_FIXTURES = ("student",)  # fixtures that launch processes: their tests are marked integration

EVAL_FID = os.path.join(REPO, "launch", "eval_fid.py")
WIDTH = 16  # the tiny network's feature width
N = 21      # samples: odd, split unevenly by the ranks and the batch sizes


class TinyInception(torch.nn.Module):
    """inception-2015-12-05.pt's call convention at toy size: uint8 / float [B, 3, H, W] in [0, 255], resized to
    29 x 29 inside, normalised to [-1, 1]; `return_features=True` gives [B, WIDTH] features, else logits."""

    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, stride=2)
        self.fc = torch.nn.Linear(8 * 4 * 4, width)
        self.head = torch.nn.Linear(width, 10)

    def forward(self, img, return_features: bool = False):
        x = F.interpolate(img.to(torch.float32), size=[29, 29], mode="bilinear", align_corners=False)
        h = torch.relu(self.conv((x - 128.0) / 128.0))
        f = torch.tanh(3.0 * self.fc(F.adaptive_avg_pool2d(h, 4).flatten(1)))
        return f if return_features else self.head(f)


def write_net_file(folder) -> str:
    """A random TinyInception saved as TorchScript, the inception-2015-12-05.pt file format."""
    torch.manual_seed(3)
    path = str(folder / "tiny-inception.pt")
    torch.jit.save(torch.jit.script(TinyInception().eval()), path)
    return path


def write_ref_file(folder) -> str:
    """Synthetic reference statistics [WIDTH], plus an array a reader must ignore (ADM files hold images)."""
    g = np.random.default_rng(0)
    a = g.normal(size=(WIDTH, WIDTH))
    path = str(folder / "ref.npz")
    np.savez(path, mu=0.1 * g.normal(size=WIDTH), sigma=0.05 * a @ a.T / WIDTH, arr_0=np.zeros((2, 4, 4, 3), np.uint8))
    return path


@pytest.fixture(scope="module")
def net_file(tmp_path_factory) -> str:
    return write_net_file(tmp_path_factory.mktemp("inception"))


@pytest.fixture(scope="module")
def ref_file(tmp_path_factory) -> str:
    return write_ref_file(tmp_path_factory.mktemp("ref"))


# ---- a. streaming statistics against a closed form -------------------------------------------------------

def _features(n: int, mu: np.ndarray, lam: np.ndarray, rot: np.ndarray, g) -> np.ndarray:
    """n rows whose mean is exactly mu and whose unbiased covariance is exactly rot diag(lam) rot^T: the centred
    columns of a random matrix, orthonormalised (QR keeps them orthogonal to the all-ones vector), scaled."""
    m = g.normal(size=(n, len(mu)))
    q, _ = np.linalg.qr(m - m.mean(0))
    return mu + (q * np.sqrt((n - 1) * lam)) @ rot.T


def _streamed(feats: np.ndarray, splits: list, float32: bool = False) -> FeatureStats:
    """Statistics of `feats` accumulated by len(splits) + 1 partial "ranks", each in 3 uneven batches, then merged;
    with `float32` (features exact in float32) the odd-sized batches go in as float32 tensors."""
    ranks = []
    for part in np.split(feats, splits):
        s = FeatureStats(feats.shape[1])
        for batch in np.array_split(part, 3):
            t = torch.from_numpy(batch)
            s.update(t.float() if float32 and len(batch) % 2 else t)
        ranks.append(s)
    total = FeatureStats(feats.shape[1])
    for s in ranks:
        total.merge(s)
    return total


def test_streaming_fid_matches_closed_form():
    g = np.random.default_rng(1)
    d = 6
    rot, _ = np.linalg.qr(g.normal(size=(d, d)))
    mu_a, mu_b = g.normal(size=d), g.normal(size=d)
    lam_a, lam_b = g.uniform(0.2, 2.0, d), g.uniform(0.2, 2.0, d)
    lam_b[0] = 0.0  # a singular covariance too
    fa = _features(37, mu_a, lam_a, rot, g).astype(np.float32).astype(np.float64)  # float32 features, as a network's
    fb = _features(50, mu_b, lam_b, rot, g)
    a, b = _streamed(fa, [5, 6, 20], float32=True), _streamed(fb, [13, 40])
    assert a.count == 37 and b.count == 50
    ma, ca = a.mean_cov()
    mb, cb = b.mean_cov()
    np.testing.assert_allclose(ma, fa.mean(0), rtol=0, atol=1e-12)
    np.testing.assert_allclose(ca, np.cov(fa, rowvar=False), rtol=0, atol=1e-12)
    np.testing.assert_allclose(mb, mu_b, rtol=0, atol=1e-12)
    np.testing.assert_allclose(cb, rot @ np.diag(lam_b) @ rot.T, rtol=0, atol=1e-12)
    # fb's moments are the construction's to float64 rounding, fa's (rounded to float32) only to ~1e-7: the closed
    # form is checked on (construction a, streamed b), the streamed pair against np.mean / np.cov
    fid_b = gaussian_frechet(mu_a, rot @ np.diag(lam_a) @ rot.T, mb, cb)
    closed = np.sum((mu_a - mu_b) ** 2) + np.sum((np.sqrt(lam_a) - np.sqrt(lam_b)) ** 2)
    assert fid_b == pytest.approx(closed, rel=1e-9, abs=1e-12)
    fid_ab = gaussian_frechet(ma, ca, mb, cb)
    assert fid_ab == pytest.approx(gaussian_frechet(fa.mean(0), np.cov(fa, rowvar=False), mu_b,
                                                    rot @ np.diag(lam_b) @ rot.T), rel=1e-9)
    with pytest.raises(ValueError, match="at least 2 samples"):
        FeatureStats(d).mean_cov()


def _tol(d: int, dtype) -> float:
    """stats_problem's relative rounding tolerance, restated: D eps_64 + sqrt(D) eps of the stored dtype."""
    return d * np.finfo(np.float64).eps + np.sqrt(d) * np.finfo(dtype).eps


@pytest.mark.parametrize("d", [16, 257])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_ref_stats_checks_follow_the_rounding_of_their_dtype(d, dtype):
    """Real covariances of too few ReLU features (rank 4 of D: eigenvalues ~0 up to rounding), stored in each dtype,
    pass; the same matrix pushed by 4x the tolerance below 0 along a null vector, or made asymmetric by 4x it,
    is refused naming the eigenvalue / the entry; at 1/4 of the tolerance it still passes (the check is neither
    exact nor loose)."""
    g = np.random.default_rng(d)
    f = np.maximum(g.normal(size=(5, d)), 0) * 3
    mu, sigma = f.mean(0), np.cov(f, rowvar=False)
    assert stats_problem(mu, sigma.astype(dtype)) is None
    w, v = np.linalg.eigh(sigma)
    tol = _tol(d, dtype)
    null = np.abs(w).max() * np.outer(v[:, 0], v[:, 0])  # along an eigenvector of a (near) 0 eigenvalue
    assert stats_problem(mu, (sigma - 0.25 * tol * null).astype(dtype)) is None
    bad = stats_problem(mu, (sigma - 4 * tol * null).astype(dtype))
    assert bad is not None and "not positive semi-definite" in bad and "smallest eigenvalue is -" in bad, bad
    off = np.zeros((d, d))
    off[2, 5] = np.abs(sigma).max()
    assert stats_problem(mu, (sigma + 0.25 * tol * off).astype(dtype)) is None
    bad = stats_problem(mu, (sigma + 4 * tol * off).astype(dtype))
    assert bad is not None and "not symmetric: sigma[2, 5]" in bad, bad


def test_ref_stats_shapes_values_and_dtypes_are_named():
    mu, sigma = np.zeros(4), np.eye(4)
    assert stats_problem(mu, sigma) is None and stats_problem(mu, np.zeros((4, 4))) is None
    assert "'mu' has shape [4, 1] and 'sigma' [4, 4]" in stats_problem(mu[:, None], sigma)
    assert "expected [D] and [D, D] with D >= 1" in stats_problem(np.zeros(0), np.zeros((0, 0)))
    s = sigma.copy()
    s[1, 2] = s[2, 1] = np.nan
    s[3, 3] = np.inf
    assert stats_problem(mu, s) == "'sigma' holds 3 NaN / inf value(s) (the first at [1, 2])"
    assert stats_problem(np.array([0, np.nan, 0, 0]), sigma).startswith("'mu' holds 1 NaN / inf value(s)")
    assert "'sigma' has dtype <U1" in stats_problem(mu, np.full((4, 4), "a"))
    assert stats_problem(np.zeros(2, np.int64), np.eye(2, dtype=np.int64)) is None


# ---- b. pixels, noise, sharded streams -------------------------------------------------------------------

def test_pixels_to_uint8():
    x = torch.tensor([-1.0, 1.0, 0.0, -2.0, 3.0, float("nan"), 0.5]).view(1, 1, 1, 7)
    assert pixels_to_uint8(x).shape == (1, 3, 1, 7)
    assert pixels_to_uint8(x)[0, :, 0].tolist() == [[0, 255, 128, 0, 255, 0, 191]] * 3  # 191.25 -> 191
    assert pixels_to_uint8(x, "floor")[0, 0, 0].tolist() == [0, 255, 127, 0, 255, 0, 191]
    g = torch.Generator().manual_seed(0)
    rgb = torch.rand((2, 3, 5, 7), generator=g) * 2.4 - 1.2
    v = (rgb.double() + 1) * 127.5
    keep = (v - v.floor() - 0.5).abs() > 1e-4  # away from the halves, where float32 rounding may decide
    want_round = (v + 0.5).floor().clamp(0, 255)
    want_floor = v.floor().clamp(0, 255)
    assert torch.equal(pixels_to_uint8(rgb).double()[keep], want_round[keep])
    assert torch.equal(pixels_to_uint8(rgb, "floor").double(), want_floor)


def test_keyed_noise_depends_only_on_seed_and_index():
    shape = (1, 3, 2)
    whole = keyed_noise(7, range(6), shape, draws=2)
    assert whole.shape == (2, 6, *shape)
    assert torch.equal(keyed_noise(7, [4, 1], shape, draws=2), whole[:, [4, 1]])
    assert torch.equal(keyed_noise(7, [3], shape, draws=2)[:, 0], whole[:, 3])
    assert not torch.equal(keyed_noise(8, [3], shape, draws=2)[:, 0], whole[:, 3])
    assert not torch.equal(whole[:, 0], whole[:, 1])


def test_stream_is_independent_of_batches_and_ranks(net_file):
    net = torch.jit.load(net_file)

    def images(batch):  # deterministic per index, like eval_fid's sampler
        return pixels_to_uint8(keyed_noise(5, batch, (3, 12, 10))[0].clamp(-1, 1))

    @torch.no_grad()
    def feats(u8):
        return net(u8, return_features=True).double()

    n = 23
    every = feats(images(range(n))).numpy()
    runs = {}
    for ranks, batch in ((1, 1), (1, 5), (3, 4)):
        total = FeatureStats(WIDTH)
        for r in range(ranks):
            total.merge(stream_stats(shard_indices(n, r, ranks), batch, images, feats, WIDTH))
        assert total.count == n
        runs[ranks, batch] = total.mean_cov()
    for mu, sigma in runs.values():
        np.testing.assert_allclose(mu, every.mean(0), rtol=0, atol=1e-6)
        np.testing.assert_allclose(sigma, np.cov(every, rowvar=False), rtol=0, atol=1e-7)


# ---- c. end to end -------------------------------------------------------------------------------------

def _fid_scipy(mu1, s1, mu2, s2) -> float:
    """The TTUR / StyleGAN3 formula with scipy's matrix square root (independent of eval.frechet)."""
    covmean = scipy.linalg.sqrtm(s1 @ s2).real
    return float(np.sum((mu1 - mu2) ** 2) + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean))


def _printed_fid(out: str) -> float:
    m = re.search(r"^> FID (\S+) \(N=(\d+), ", out, re.M)
    assert m, f"no FID line in:\n{out[-2000:]}"
    return float(m.group(1))


def _regenerated_stats(load: str, net_file: str, n: int, seed: int, steps, guidance: float, no_ema: bool = False,
                       decode=None):
    """np.mean / np.cov of the features of all n samples made at once from the library's parts (`decode`: latents
    -> pixels in [-1, 1])."""
    with world_of_one() as ps:
        payload = load_payload(load, ps)
        info = payload["data_info"]
        model, _ = load_sampling_model(payload, info, ps, no_ema=no_ema)
        sampler = checkpoint_sampler(payload, steps, guidance, None)
        noise = keyed_noise(seed, range(n), tuple(info["latent_shape"]), sampler.draws)
        x = sampler(model.eval(), noise, torch.arange(n) % info["num_classes"])
    with torch.no_grad():
        x = decode(x) if decode is not None else x
        f = torch.jit.load(net_file)(pixels_to_uint8(x), return_features=True).double().numpy()
    return f.mean(0), np.cov(f, rowvar=False)


def _run_in_process(capsys, argv: list) -> str:
    with world_of_one():
        rc = eval_fid.main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, f"{out[-2000:]}\n{err[-2000:]}"
    return out


@pytest.mark.integration
def test_eval_fid_teacher_one_and_two_ranks(debug_teacher, net_file, ref_file, tmp_path, capsys):
    common = ["--load", debug_teacher, "--ref-stats", ref_file, "--inception-weights", net_file,
              "--num-samples", str(N), "--steps", "2", "--guidance", "1.5", "--seed", "3"]
    one, two = tmp_path / "one", tmp_path / "two"
    with ThreadPoolExecutor(1) as pool:  # the 2-rank job starts first; the in-process run overlaps its start-up
        job = pool.submit(torchrun, 2, EVAL_FID, common + ["--batch-size", "3", "--out", str(two), "--save-stats",
                                                           str(two / "stats.npz")], timeout=120)
        out = _run_in_process(capsys, common + ["--batch-size", "4", "--out", str(one),
                                                "--save-stats", str(one / "stats.npz")])
        r = job.result().check("eval_fid.py on 2 ranks")
    assert f"> samples {N}/{N} (" in out
    assert f"(N={N}, teacher 2 Euler steps, guidance 1.5, shift 1, raw weights, ref {ref_file}" in out
    ref = np.load(ref_file)
    results = {}
    for name, text in (("one", out), ("two", r.stdout)):
        record = json.load(open(tmp_path / name / "fid.json"))
        stats = np.load(tmp_path / name / "stats.npz")
        assert int(stats["num_samples"]) == N and record["num_samples"] == N and record["feature_dim"] == WIDTH
        assert _printed_fid(text) == pytest.approx(record["fid"], abs=5e-5)
        assert record["fid"] == pytest.approx(_fid_scipy(stats["mu"], stats["sigma"], ref["mu"], ref["sigma"]),
                                              rel=1e-6)
        results[name] = record["fid"], stats["mu"], stats["sigma"]
    assert results["one"][0] > 0.01  # the check below cannot pass by both being 0
    assert results["one"][0] == pytest.approx(results["two"][0], rel=1e-5)
    np.testing.assert_allclose(results["one"][1], results["two"][1], rtol=0, atol=1e-6)
    np.testing.assert_allclose(results["one"][2], results["two"][2], rtol=0, atol=1e-7)
    mu, sigma = _regenerated_stats(debug_teacher, net_file, N, 3, 2, 1.5)
    np.testing.assert_allclose(results["one"][1], mu, rtol=0, atol=1e-6)
    np.testing.assert_allclose(results["one"][2], sigma, rtol=0, atol=1e-7)


@pytest.fixture(scope="module")
def student(debug_teacher, tmp_path_factory) -> str:
    """The debug teacher's weights saved as a DMD2 student: its own 2-point grid and an EMA off its weights."""
    payload = torch.load(rank_file(iter_dir(debug_teacher, latest_iteration(debug_teacher)), 0), weights_only=False)
    g = torch.Generator().manual_seed(1)
    payload["student_sigmas"] = [1.0, 0.55]
    payload["ema"] = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in payload["model"].items()
                      if isinstance(v, torch.Tensor) and v.is_floating_point()}
    save = str(tmp_path_factory.mktemp("student") / "student")
    save_offline(save, payload["iteration"], [payload])
    return save


def test_eval_fid_student_ema_and_raw(student, net_file, ref_file, tmp_path, capsys):
    n, fids = 12, {}
    for no_ema in (False, True):
        stats = tmp_path / f"stats_{no_ema}.npz"
        out = _run_in_process(capsys, ["--load", student, "--ref-stats", ref_file, "--inception-weights", net_file,
                                       "--num-samples", str(n), "--batch-size", "5", "--save-stats", str(stats)]
                              + ["--no-ema"] * no_ema)
        weights = "raw weights" if no_ema else "EMA weights"
        assert f"(N={n}, student 2 steps, {weights}, ref" in out
        fids[no_ema] = _printed_fid(out)
        saved = np.load(stats)
        mu, sigma = _regenerated_stats(student, net_file, n, 0, None, 1.25, no_ema=no_ema)
        np.testing.assert_allclose(saved["mu"], mu, rtol=0, atol=1e-6)
        np.testing.assert_allclose(saved["sigma"], sigma, rtol=0, atol=1e-7)
    assert abs(fids[False] - fids[True]) > 1e-3, fids  # the EMA weights really were the ones sampled


def test_eval_fid_decodes_latents_with_vae(net_file, ref_file, tmp_path, capsys):
    """Class-conditional latents [4, 8, 8] and a tiny AutoencoderKL (scaling 0.5, x2 spatial): the statistics are
    those of diffusers' decode of latents / 0.5 (16 x 16 RGB); without --vae the latents are refused."""
    from diffusers import AutoencoderKL
    d = str(tmp_path)
    kl_latent_teacher(d, classes=3)
    capsys.readouterr()
    argv = ["--load", f"{d}/t", "--ref-stats", ref_file, "--inception-weights", net_file, "--num-samples", "7",
            "--steps", "1", "--batch-size", "3"]
    out = _run_in_process(capsys, argv + ["--vae", f"{d}/kl", "--save-stats", f"{d}/stats.npz"])
    assert "> FID " in out and "(N=7, teacher 1 Euler steps, guidance 1.25" in out
    vae = AutoencoderKL.from_pretrained(f"{d}/kl").eval()
    mu, sigma = _regenerated_stats(f"{d}/t", net_file, 7, 0, 1, 1.25,
                                   decode=lambda z: vae.decode(z / 0.5).sample.clamp(-1, 1))
    saved = np.load(f"{d}/stats.npz")
    np.testing.assert_allclose(saved["mu"], mu, rtol=0, atol=1e-6)
    np.testing.assert_allclose(saved["sigma"], sigma, rtol=0, atol=1e-7)
    with world_of_one():
        rc = eval_fid.main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.startswith("ConfigError: ") and "makes latents [4, 8, 8]" in err and "--vae DIR" in err


# ---- d. mistakes ---------------------------------------------------------------------------------------

def _mistake(case: str, d, net_file: str, ref_file: str) -> tuple:
    """(flags replacing the defaults, needles of the one-line ConfigError)."""
    if case == "inception-missing":
        return (["--inception-weights", str(d / "inception-2015-12-05.pt")],
                [str(d / "inception-2015-12-05.pt"), "does not exist",
                 "https://nvlabs-fi-cdn.nvidia.com/stylegan2-ada-pytorch/pretrained/metrics/inception-2015-12-05.pt",
                 "nothing is downloaded"])
    if case == "inception-state-dict":
        torch.save(TinyInception().state_dict(), d / "weights-inception-2015-12-05-6726825d.pth")
        return (["--inception-weights", str(d / "weights-inception-2015-12-05-6726825d.pth")],
                ["weights-inception-2015-12-05-6726825d.pth", "plain state dict",
                 "download inception-2015-12-05.pt"])
    if case == "ref-keys":
        np.savez(d / "ref.npz", mean=np.zeros(WIDTH), cov=np.eye(WIDTH))
        return ["--ref-stats", str(d / "ref.npz")], [str(d / "ref.npz"), "'mu' / 'sigma'", "['mean', 'cov']"]
    if case == "ref-shapes":
        np.savez(d / "ref.npz", mu=np.zeros(WIDTH), sigma=np.eye(WIDTH + 1))
        return ["--ref-stats", str(d / "ref.npz")], [str(d / "ref.npz"), "[16] and 'sigma' [17, 17]"]
    if case == "ref-negative-definite":  # printed "FID 0.0000"
        np.savez(d / "ref.npz", mu=np.zeros(WIDTH), sigma=-100 * np.eye(WIDTH))
        return ["--ref-stats", str(d / "ref.npz")], [str(d / "ref.npz"), "'sigma' is not positive semi-definite",
                                                     "smallest eigenvalue is -100"]
    if case == "ref-asymmetric":
        a = np.random.default_rng(0).normal(size=(WIDTH, WIDTH))
        np.savez(d / "ref.npz", mu=np.zeros(WIDTH), sigma=a @ a.T + np.triu(a, 1))
        return ["--ref-stats", str(d / "ref.npz")], [str(d / "ref.npz"), "'sigma' is not symmetric: sigma["]
    if case == "ref-nan":
        np.savez(d / "ref.npz", mu=np.full(WIDTH, np.nan), sigma=np.eye(WIDTH))
        return ["--ref-stats", str(d / "ref.npz")], [str(d / "ref.npz"), f"'mu' holds {WIDTH} NaN / inf"]
    if case == "ref-truncated":  # was a zipfile.BadZipFile traceback
        raw = open(ref_file, "rb").read()
        open(d / "ref.npz", "wb").write(raw[:len(raw) // 2])
        return ["--ref-stats", str(d / "ref.npz")], [str(d / "ref.npz"), "is not a readable .npz", "BadZipFile"]
    if case == "ref-npy":  # was a TypeError traceback (np.load returns the array)
        np.save(d / "ref.npy", np.zeros(WIDTH))
        return ["--ref-stats", str(d / "ref.npy")], [str(d / "ref.npy"), "is a single .npy array", "'mu' [D]"]
    if case == "ref-dir":  # said "does not exist"
        os.makedirs(d / "stats")
        return ["--ref-stats", str(d / "stats")], [str(d / "stats"), "is a directory; expected a file"]
    if case == "ref-width":
        np.savez(d / "ref.npz", mu=np.zeros(8), sigma=np.eye(8))
        return ["--ref-stats", str(d / "ref.npz")], [str(d / "ref.npz"), "8-dim", net_file, f"{WIDTH}-dim"]
    assert case == "vae-on-pixels"
    os.makedirs(d / "vae")
    json.dump({"_class_name": "AutoencoderKL", "latent_channels": 4}, open(d / "vae" / "config.json", "w"))
    return ["--vae", str(d / "vae")], ["--vae", "--data digits holds pixels"]


@pytest.mark.parametrize("case", ["inception-missing", "inception-state-dict", "ref-keys", "ref-shapes", "ref-width",
                                  "ref-negative-definite", "ref-asymmetric", "ref-nan", "ref-truncated", "ref-npy",
                                  "ref-dir", "vae-on-pixels"])
def test_eval_fid_mistake_is_one_line(case, debug_teacher, net_file, ref_file, tmp_path, capsys):
    flags, needles = _mistake(case, tmp_path, net_file, ref_file)
    defaults = {"--load": debug_teacher, "--ref-stats": ref_file, "--inception-weights": net_file}
    defaults.update(zip(flags[::2], flags[1::2]))
    argv = [x for kv in defaults.items() for x in kv] + ["--num-samples", "4", "--steps", "1",
                                                         "--out", str(tmp_path / "out")]
    with world_of_one():
        rc = eval_fid.main(argv)
    out, err = capsys.readouterr()
    assert rc == 1, f"{out[-2000:]}\n{err[-2000:]}"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ConfigError: "), err
    for needle in needles:
        assert needle in lines[0], f"stderr should name {needle!r}: {lines[0]}"
    assert "> FID" not in out and not os.path.exists(tmp_path / "out"), "nothing is sampled for a mistake"
