"""Backward-simulation rollout (dmd2_mega/methods/rollout.py) against an independent reference.

Reference: a sequential, per-sample float64 loop written here from the module docstring's maths,
consuming the generator in the documented order (stop steps [n], initial noise [n, *shape], then
one full-batch fresh draw [n, *shape] per transition i -> i+1):
    x = eps_0[j]; for i = 0..i_j: v = f(x, sigma_i, c_j); x0 = x - sigma_i v;
                                  if i < i_j: x = (1 - sigma_{i+1}) x0 + sigma_{i+1} eps_{i+1}[j]
The fake student f(x, sigma, c) = a x + b sigma + table[c] (float64, per sample, so batching does
not change its output) records the batch size of every call.
"""
import pytest
import torch

from dmd2_mega.config import ModelConfig
from dmd2_mega.methods.rollout import Rollout, bucket_stop_steps, draw_stop_steps, rollout, stop_steps_on
from dmd2_mega.errors import ConfigError, FlowError, GridError, RolloutError
from dmd2_mega.flow import shift_sigma, student_sigmas
from dmd2_mega.models import DataShape, build_model
from dmd2_mega.distributed.parallel import micro_batch_generator
from tests.utils import world_of_one

pytestmark = pytest.mark.timeout(60)
SHAPE = (1, 3, 2)  # odd sizes on purpose


class FakeStudent(torch.nn.Module):
    def __init__(self, classes=5, a=-0.3, b=0.7):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.a, self.b = a, b
        self.table = torch.nn.Parameter(torch.randn(classes, *SHAPE, generator=g, dtype=torch.float64))
        self.calls = []

    def forward(self, x, sigma, cond):
        self.calls.append(x.shape[0])
        s = sigma.double().reshape(-1, *([1] * (x.ndim - 1)))
        return self.a * x.double() + self.b * s + self.table[cond]


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def labels(n, seed=3):
    return torch.randint(0, 5, (n,), generator=gen(seed))


@torch.no_grad()
def reference(student, seed, n, cond, sigmas, dtype=torch.float64, shape=SHAPE):
    g, steps = gen(seed), len(sigmas)
    stop = torch.randint(0, steps, (n,), generator=g)
    eps0 = torch.randn((n, *shape), generator=g, dtype=dtype)
    fresh = [torch.randn((n, *shape), generator=g, dtype=dtype) for _ in range(steps - 1)]
    sig = [float(s) for s in sigmas.float()]
    xs, x0s = [], []
    for j in range(n):
        x = eps0[j].double()
        for i in range(int(stop[j]) + 1):
            v = student(x[None], torch.tensor([sig[i]], dtype=torch.float32), cond[j:j + 1])[0].double()
            x0 = x - sig[i] * v
            if i == stop[j]:
                break
            x = (1 - sig[i + 1]) * x0 + sig[i + 1] * fresh[i][j].double()
        xs.append(x)
        x0s.append(x0)
    return stop, torch.stack(xs), torch.stack(x0s), eps0, fresh


def run(student, seed, n, cond, sigmas, **kw):
    kw.setdefault("dtype", torch.float64)
    return rollout(student, gen(seed), n, cond, sigmas, shape=SHAPE, device="cpu", **kw)


# ---- student_sigmas -------------------------------------------------------------------------------

def test_default_grid_and_shift():
    assert torch.equal(student_sigmas(4), torch.tensor([1.0, 0.75, 0.5, 0.25]))
    assert torch.equal(student_sigmas(1), torch.tensor([1.0]))
    s = torch.tensor([1.0, 2 / 3, 1 / 3], dtype=torch.float64)
    got = student_sigmas(3, shift=3.0)
    assert got.dtype == torch.float32
    assert torch.equal(got, (3 * s / (1 + 2 * s)).float())
    ex = student_sigmas(explicit=[1.0, 0.6, 0.1], shift=2.5)
    assert torch.equal(ex, shift_sigma(torch.tensor([1.0, 0.6, 0.1], dtype=torch.float64), 2.5).float())
    assert len(student_sigmas(7, explicit=[1.0, 0.5])) == 2  # explicit wins


@pytest.mark.parametrize("explicit, match", [
    ([], "at least one"), ([0.9, 0.5], "start at 1.0"), ([1.0, 0.5, 0.5], "strictly decreasing"),
    ([1.0, 0.2, 0.4], "strictly decreasing"), ([1.0, 0.0], r"\(0, 1\]"), ([1.0, -0.1], r"\(0, 1\]"),
    ([1.2, 0.5], r"\(0, 1\]"), ([1.0, float("nan")], r"\(0, 1\]")])
def test_explicit_grid_rejected(explicit, match):
    with pytest.raises(GridError, match="--dmd2-student-sigmas") as e:
        student_sigmas(explicit=explicit)
    assert e.match(match) and isinstance(e.value, ConfigError) and isinstance(e.value, FlowError)


@pytest.mark.parametrize("n", [0, -1, 2.0, True])
def test_num_steps_rejected(n):
    with pytest.raises(GridError, match="--dmd2-denoising-steps"):
        student_sigmas(n)


# ---- rollout against the reference ---------------------------------------------------------------

@pytest.mark.parametrize("n, steps, shift", [(1, 4, 1.0), (7, 4, 3.0), (13, 1, 1.0), (9, 3, 2.0)])
def test_matches_sequential_reference(n, steps, shift):
    sigmas, cond = student_sigmas(steps, shift=shift), labels(n)
    ro = run(FakeStudent(), 11, n, cond, sigmas, sample_id_offset=100)
    stop, x, x0, _, _ = reference(FakeStudent(), 11, n, cond, sigmas)
    assert isinstance(ro, Rollout) and len(ro) == n
    assert ro.x.shape == ro.x0hat.shape == (n, *SHAPE)
    assert ro.sigma.shape == ro.stop_step.shape == ro.sample_id.shape == (n,)
    assert ro.sigma.dtype == torch.float32 and ro.stop_step.dtype == ro.sample_id.dtype == torch.int64
    assert torch.equal(ro.stop_step, stop)
    assert torch.equal(ro.sample_id, torch.arange(100, 100 + n))
    assert torch.equal(ro.sigma, sigmas[stop])
    assert torch.equal(ro.cond, cond)
    torch.testing.assert_close(ro.x, x, rtol=0, atol=1e-12)
    torch.testing.assert_close(ro.x0hat, x0, rtol=0, atol=1e-12)


def test_float32_rollout_close_to_reference():
    n, sigmas, cond = 10, student_sigmas(4, shift=2.0), labels(10)
    ro = run(FakeStudent(), 5, n, cond, sigmas, dtype=torch.float32)
    _, x, x0, _, _ = reference(FakeStudent(), 5, n, cond, sigmas, dtype=torch.float32)
    assert ro.x.dtype == ro.x0hat.dtype == torch.float32
    torch.testing.assert_close(ro.x.double(), x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ro.x0hat.double(), x0, rtol=1e-5, atol=1e-5)


def test_x0hat_is_the_student_prediction_at_the_kept_point():
    n, sigmas, cond, f = 11, student_sigmas(4, shift=3.0), labels(11), FakeStudent()
    ro = run(f, 2, n, cond, sigmas)
    expect = ro.x - ro.sigma.double().reshape(-1, 1, 1, 1) * f(ro.x, ro.sigma, ro.cond)
    torch.testing.assert_close(ro.x0hat, expect, rtol=0, atol=1e-12)


def test_fresh_noise_in_the_prefix():
    """With v = x / sigma the student's x0 is 0, so x at stop step i > 0 is sigma_i * eps_i, the
    fresh draw of transition i-1 -> i, never the initial noise or another transition's draw."""
    class ZeroX0(torch.nn.Module):
        def forward(self, x, sigma, cond):
            return x / sigma.double().reshape(-1, 1, 1, 1)

    n, sigmas = 64, student_sigmas(4)
    ro = run(ZeroX0(), 9, n, torch.zeros(n, dtype=torch.long), sigmas)
    stop, _, _, eps0, fresh = reference(ZeroX0(), 9, n, torch.zeros(n, dtype=torch.long), sigmas)
    for j in range(n):
        i = int(stop[j])
        noise = ro.x[j] / float(sigmas[i])
        expect = eps0[j] if i == 0 else fresh[i - 1][j]
        torch.testing.assert_close(noise, expect, rtol=0, atol=1e-12)
        others = [eps0[j]] + [f[j] for f in fresh]
        assert sum(torch.allclose(noise, o, atol=1e-9) for o in others) == 1
    assert (stop > 0).sum() > n // 2


def test_every_stop_step_occurs_and_forward_count():
    n, steps = 4000, 4
    f = FakeStudent()
    ro = run(f, 1, n, labels(n), student_sigmas(steps), dtype=torch.float32)
    counts = torch.bincount(ro.stop_step, minlength=steps)
    assert counts.min() > 0.9 * n / steps and counts.max() < 1.1 * n / steps, counts
    running = [int((ro.stop_step >= i).sum()) for i in range(steps)]
    assert f.calls == running  # one batched forward per step, on the running samples only
    assert sum(f.calls) == int((ro.stop_step + 1).sum())


def test_one_sample_per_stop_shapes():
    n, steps = 1, 4
    for seed in range(12):
        ro = run(FakeStudent(), seed, n, labels(n), student_sigmas(steps))
        assert ro.x.shape == (1, *SHAPE) and 0 <= int(ro.stop_step) < steps


def test_same_generator_same_rollout_and_generator_state():
    n, sigmas, cond = 12, student_sigmas(4), labels(12)
    ga, gb = micro_batch_generator(5, 3, 1, torch.device("cpu")), micro_batch_generator(5, 3, 1, torch.device("cpu"))
    a = rollout(FakeStudent(), ga, n, cond, sigmas, shape=SHAPE, device="cpu")
    b = rollout(FakeStudent(), gb, n, cond, sigmas, shape=SHAPE, device="cpu")
    for field in ("x", "sigma", "x0hat", "cond", "sample_id", "stop_step"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert torch.equal(ga.get_state(), gb.get_state())
    c = rollout(FakeStudent(), micro_batch_generator(5, 3, 2, torch.device("cpu")), n, cond, sigmas,
                shape=SHAPE, device="cpu")
    assert not torch.equal(a.x, c.x)
    # The stream is independent of the stop steps: 1 + 1 + (N - 1) draws, whoever stopped.
    g = gen(0)
    run_gen = gen(0)
    rollout(FakeStudent(), run_gen, n, cond, sigmas, shape=SHAPE, device="cpu")
    torch.randint(0, 4, (n,), generator=g)
    for _ in range(4):
        torch.randn((n, *SHAPE), generator=g)
    assert torch.equal(run_gen.get_state(), g.get_state())


def test_no_grad_recorded():
    f = FakeStudent()
    ro = run(f, 0, 6, labels(6), student_sigmas(3))
    assert f.table.requires_grad
    assert not ro.x0hat.requires_grad and not ro.x.requires_grad and ro.x0hat.grad_fn is None


def test_micro_batch_and_argument_errors():
    ro = run(FakeStudent(), 0, 6, labels(6), student_sigmas(3))
    mb = ro.micro_batch(1, 2)
    assert torch.equal(mb.sample_id, torch.tensor([2, 3])) and torch.equal(mb.x, ro.x[2:4])
    with pytest.raises(RolloutError, match="micro-batch 3"):
        ro.micro_batch(3, 2)
    with pytest.raises(RolloutError, match="first dim"):
        run(FakeStudent(), 0, 6, labels(5), student_sigmas(3))
    with pytest.raises(RolloutError, match="batch"):
        run(FakeStudent(), 0, 0, labels(0), student_sigmas(3))


# ---- the real debug DiT ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def world():
    with world_of_one() as ps:
        yield ps


def test_debug_dit(world):
    torch.manual_seed(0)
    model = build_model("debug", DataShape(1, 8, num_classes=10), options=ModelConfig(size="debug").options()).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # make adaLN-Zero's zeros non-zero: v depends on x
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    n, sigmas, cond = 6, student_sigmas(4, shift=2.0), torch.tensor([0, 3, 9, 10, 2, 5])
    kw = dict(shape=(1, 8, 8), device="cpu")
    a = rollout(model, gen(4), n, cond, sigmas, **kw)
    b = rollout(model, gen(4), n, cond, sigmas, **kw)
    assert torch.equal(a.x, b.x) and torch.equal(a.x0hat, b.x0hat)
    assert a.x.shape == (n, 1, 8, 8) and not a.x0hat.requires_grad
    with torch.no_grad():
        v = model(a.x, a.sigma, a.cond)
    torch.testing.assert_close(a.x0hat, a.x - a.sigma.reshape(-1, 1, 1, 1) * v, rtol=1e-5, atol=1e-5)
    stop, x, x0, _, _ = reference(lambda x, s, c: model(x.float(), s, c), 4, n, cond, sigmas, torch.float32,
                                 shape=(1, 8, 8))
    assert torch.equal(a.stop_step, stop)
    torch.testing.assert_close(a.x.double(), x, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a.x0hat.double(), x0, rtol=1e-4, atol=1e-4)


def test_max_batch_chunks_forwards_without_changing_the_rollout():
    sigmas = student_sigmas(4)
    cond = labels(23)
    whole, chunked = FakeStudent(), FakeStudent()
    a = run(whole, 5, 23, cond, sigmas)
    b = run(chunked, 5, 23, cond, sigmas, max_batch=4)
    assert max(chunked.calls) <= 4 and sum(chunked.calls) == sum(whole.calls)
    for name in ("x", "sigma", "x0hat", "stop_step", "sample_id"):
        torch.testing.assert_close(getattr(b, name), getattr(a, name), rtol=0, atol=1e-12)


# ---- no host round trip ---------------------------------------------------------------------------

def test_stop_steps_come_from_the_host_generator():
    """With a separate stop_gen, the stop steps are its draw and the noise stream is noise_gen's alone."""
    student, sigmas, n = FakeStudent(), student_sigmas(4), 9
    cond = labels(n)
    r = rollout(student, gen(5), n, cond, sigmas, shape=SHAPE, device="cpu", dtype=torch.float64, stop_gen=gen(11))
    assert torch.equal(r.stop_step, torch.randint(0, 4, (n,), generator=gen(11)))
    eps0 = torch.randn((n, *SHAPE), generator=gen(5), dtype=torch.float64)  # noise_gen's first draw
    first = r.stop_step == 0  # samples that stop at step 0 keep x = eps_0
    assert first.any() and torch.equal(r.x[first], eps0[first])


def test_rollout_reads_nothing_back_from_the_device():
    """On the meta device every read of a tensor's values raises, so a rollout there proves it has no
    device -> host round trip (the old prefix lengths were a `.tolist()` of device counts)."""
    n, sigmas = 8, student_sigmas(4)
    r = rollout(lambda x, s, c: 0.5 * x, gen(0), n, torch.zeros(n, dtype=torch.int64, device="meta"), sigmas,
                shape=SHAPE, device="meta", stop_gen=gen(1))
    assert r.x.device.type == "meta" and r.x.shape == (n, *SHAPE) and r.stop_step.device.type == "meta"
    with pytest.raises(Exception):
        r.stop_step.tolist()  # what the property rests on


def test_stop_gen_must_be_on_the_host():
    class DeviceGen:
        device = torch.device("cuda")
    with pytest.raises(RolloutError, match="stop steps are drawn on the host"):
        rollout(FakeStudent(), DeviceGen(), 4, labels(4), student_sigmas(2), shape=SHAPE, device="cpu")


# ---- stop steps drawn ahead for a cycle -------------------------------------------------------------

def test_stop_steps_drawn_ahead_give_each_rollout_its_own_draws():
    """A cycle draws every micro-batch's stop steps first (`draw_stop_steps`, one copy): bit-equal to each rollout
    drawing its own from its stop generator, generators left in the same states. A draw for another rollout size or
    grid is refused."""
    sigmas, n, m = student_sigmas(4), 7, 3
    cond = labels(n)
    own = [run(FakeStudent(), j, n, cond, sigmas, stop_gen=gen(10 + j)) for j in range(m)]
    stop_gens = [gen(10 + j) for j in range(m)]
    ahead = draw_stop_steps(stop_gens, n, len(sigmas), "cpu")
    noise_gens = [gen(j) for j in range(m)]
    drawn = [rollout(FakeStudent(), g, n, cond, sigmas, shape=SHAPE, device="cpu", dtype=torch.float64, stops=st)
             for g, st in zip(noise_gens, ahead)]
    for a, b in zip(own, drawn):
        for name in ("x", "sigma", "x0hat", "cond", "sample_id", "stop_step"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    for j in range(m):
        reference_gen = gen(10 + j)
        torch.randint(0, len(sigmas), (n,), generator=reference_gen)
        assert torch.equal(stop_gens[j].get_state(), reference_gen.get_state())
    with pytest.raises(RolloutError, match="not this rollout's 6 samples over 4"):
        run(FakeStudent(), 0, 6, labels(6), sigmas, stops=ahead[0])


def test_bucket_stop_steps_run_every_forward_size():
    """The n rollouts of `bucket_stop_steps` run a forward of every size 1..n (n at step 0), chunked by max_batch
    as a cycle's rollouts are: the warm-up set of shapes a CUDA graph per shape needs."""
    n, steps = 6, 3
    for max_batch, sizes in ((None, set(range(1, n + 1))), (4, {1, 2, 3, 4})):
        f = FakeStudent()
        for st in stop_steps_on(bucket_stop_steps(n, steps), steps, "cpu"):
            run(f, 0, n, labels(n), student_sigmas(steps), stops=st, max_batch=max_batch)
        assert set(f.calls) == sizes, (max_batch, sorted(set(f.calls)))


# ---- what the condition fixes -------------------------------------------------------------------------

def test_the_kept_x0hat_is_pinned_and_the_steps_are_not():
    """Issue 54 item 3: with `pin` (the student's `pin_given`: an I2V first frame) the kept x0hat is the pinned
    prediction, as the student's sampler returns it; x, sigma and the steps (re-noised from the unpinned x0) are
    those of the rollout without it."""
    sigmas = student_sigmas(4)
    cond = labels(9)

    def pin(x0, c):  # "the first element is fixed by the condition": its label
        out = x0.clone()
        out[:, 0, 0, 0] = c.double()
        return out
    plain, pinned = run(FakeStudent(), 2, 9, cond, sigmas), run(FakeStudent(), 2, 9, cond, sigmas, pin=pin)
    assert torch.equal(pinned.x0hat, pin(plain.x0hat, cond)) and not torch.equal(pinned.x0hat, plain.x0hat)
    for name in ("x", "sigma", "stop_step", "sample_id", "cond"):
        assert torch.equal(getattr(pinned, name), getattr(plain, name)), name


def test_dmd2s_rollout_pins_with_the_students_pin_given(world, monkeypatch):
    """DMD2's rollout step hands the student's `pin_given` to the rollout: what the critic trains on and the GAN
    head's fakes carry the condition's first frame, as the scores do (the I2V shortcut of issue 54)."""
    from types import SimpleNamespace
    from dmd2_mega.methods.base import MicroBatch
    from dmd2_mega.methods.dmd2.cycle import rollout_step
    from dmd2_mega.methods.roles import Role
    student = build_model("debug", DataShape(1, 8, num_classes=10), options=ModelConfig(size="debug").options()).eval()
    seen = []

    def marked(x0, cond):
        seen.append(x0.shape)
        return x0 + 1.0
    monkeypatch.setattr(student, "pin_given", marked)
    settings = SimpleNamespace(critic_steps=2, micro_batch_size=2, student_sigmas=student_sigmas(3), shape=(1, 8, 8),
                               device=torch.device("cpu"), rollout_chunk=None)  # what the step reads of its settings
    mb = MicroBatch(index=0, cond=labels(4) % 10, sample_id_offset=0, rollout_gen=gen(1), critic_gen=gen(2),
                    stop_gen=gen(3))
    (r,), _ = rollout_step(settings, {"student": Role("student", student)}, [mb])
    assert seen == [(4, 1, 8, 8)]
    ref = rollout(student, gen(1), 4, mb.cond, student_sigmas(3), shape=(1, 8, 8), device="cpu", stop_gen=gen(3))
    assert torch.equal(r.x0hat, ref.x0hat + 1.0)
