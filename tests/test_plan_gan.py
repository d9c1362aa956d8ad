"""The memory plan of a DMD2 run with the GAN head: the activations its forwards keep (`gan.gan_passes`, the
planner's `AddedPass`), against what those forwards keep, measured with saved-tensor hooks on built models (the
head alone exactly; the critic step's and the generator term's forwards bounded from both sides), and the plan,
the CLI and the trainer's offload choice taking them."""
import pytest
import torch

from benchmarks.plan_vs_measured import kept_bytes
from dmd2_mega.config import GANConfig
from dmd2_mega.errors import ConfigError
from dmd2_mega.methods.dmd2.gan import GANCritic, HeadOptions, gan_passes, head_plan, resolve_layer
from dmd2_mega.methods.dmd2.gan_heads import HEADS, build_head, head_kept_elements
from dmd2_mega.methods.dmd2.phases import table
from dmd2_mega.plan import memory_plan as mp
from launch import plan_memory
from tests.test_plan_memory import ACT_FACTOR, I2V_SHAPE, SHAPES, WAN_SHAPES, batch, make
from tests.utils import world_of_one


@pytest.fixture(scope="module")
def ps():
    with world_of_one() as state:
        yield state


class _Module(torch.nn.Module):
    """`kept_bytes` calls a module: this one calls `fn` with the critic's parameters as its own."""

    def __init__(self, critic, fn):
        super().__init__()
        self.critic, self.fn = critic, fn

    def forward(self, *inputs):
        return self.fn(self.critic, *inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", HEADS)
@pytest.mark.parametrize("channels,grid", [(32, (4, 4)), (32, (16, 16)), (20, (7, 9)), (16, (1, 1)),
                                           (16, (3, 2, 3)), (16, (5, 3, 5)), (48, (2, 16, 24))],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_head_kept_elements_exact(kind, channels, grid, dtype):
    """What a training forward of the head on n grids keeps for backward = `head_kept_elements` at the dtype's width:
    conv, its input and per stage three outputs and GroupNorm's statistics; mlp, three [n, C] inputs."""
    head = build_head(kind, channels, grid, 0).to(dtype)
    x = torch.randn(3, channels, *grid, dtype=dtype, requires_grad=True)
    got = kept_bytes(_Module(head, lambda h, x: h(x)), (x,))
    assert got == head_kept_elements(kind, channels, grid, 3) * (2 if dtype == torch.bfloat16 else 4)


def _critic_step(critic, x, sigma, cond, extra, own):
    return critic(x, sigma, cond, extra=extra, own=own)


def _generator_term(critic, x, sigma, cond):
    return critic.logits(x.requires_grad_(), sigma, cond)


@pytest.mark.parametrize("recompute", [None, "full"], ids=["no-recompute", "full"])
@pytest.mark.parametrize("fakes", ["own", "separate"])
@pytest.mark.parametrize("kind,bf16", [("conv", False), ("mlp", True)])
@pytest.mark.parametrize("size,ch,spatial,cond_shape", [SHAPES[0], SHAPES[2], WAN_SHAPES[2], I2V_SHAPE],
                         ids=["dit-labels", "dit-text", "wan", "wan-i2v"])
def test_gan_passes_bound_what_the_forwards_keep(ps, size, ch, spatial, cond_shape, kind, bf16, fakes, recompute):
    """The critic step with the head (B fakes' forward + the reals, separate fakes too, through blocks 0..l; the
    head on all of them, the forward's own B rows only where those are the fakes) and the actor's generator term (B
    samples through the frozen critic's blocks 0..l and its head) keep no more than the plan says (a plan that
    under-counts runs out of memory), and the plan's excess is at most the families' own (ACT_FACTOR, the DiT's) plus
    what is outside the blocks, which the planner counts whole for a forward that stops at block l (the final
    layer's share: small beside a real model's blocks). The critic step's part is what it keeps beyond the same
    forward without the head."""
    model, ms = make(ps, size, ch, spatial, cond_shape, bf16, recompute)
    n, r = 3, 2
    passes = gan_passes(GANConfig(enabled=True, head=kind, real_rows=r, fakes=fakes), ms, n)
    critic_pass, actor_pass = passes["critic"][0], passes["actor"][0]
    assert critic_pass.layers == actor_pass.layers == resolve_layer(None, ms.spec.num_layers) + 1
    critic = GANCritic(model, critic_pass.layers - 1, 0, HeadOptions(kind)).to(next(model.parameters()).dtype)
    extra = batch(ms, r, seed=1)
    if fakes == "separate":  # as many fakes as reals, noised apart, run with the reals: 2r rows
        extra = tuple(torch.cat([f, e]) for f, e in zip(batch(ms, r, seed=2), extra))
    maths = mp._maths(ms, 1, False)

    def outside(rows):
        return maths.outside(ms, rows, 1, bf16, recompute is not None, 1, False)
    # the critic step: what the head's part adds to the forward's own (whose estimate is the family's, tested apart)
    got = kept_bytes(_Module(critic, lambda c, *x: _critic_step(c, *x, extra, fakes == "own")), batch(ms, n)) \
        - kept_bytes(model, batch(ms, n))
    est = critic_pass.kept_bytes(ms, 1, bf16, recompute)
    assert got <= est <= ACT_FACTOR * got + outside(critic_pass.rows), (got, est)
    got = kept_bytes(_Module(critic, _generator_term), batch(ms, n))
    est = actor_pass.kept_bytes(ms, 1, bf16, recompute)
    assert got <= est <= ACT_FACTOR * got + outside(actor_pass.rows), (got, est)


def test_gan_passes_rows_and_the_plan_taking_them():
    """gan_passes: the critic phase's pass is the reals (own fakes: the head on the forward's B rows besides), as
    many fakes and the reals (separate) or the B fakes and the reals (clean, --no-dmd2-gan-noise), the head on those
    alone; the actor's the B samples. plan_cycle adds exactly their bytes to the phases with grad (the critic's
    beside its own forward, not the teacher's); no pass outside a phase with grad; the CLI's flags reach them;
    --dmd2-gan-real-rows above B refused as the trainer refuses it."""
    ms = mp.model_shape("wan2.1-1.3b", 16, (21, 60, 104), num_classes=None, cond_shape=(512, 4096))
    grid, layers = (21, 30, 52), 15

    def head(n):
        return head_kept_elements("conv", 1536, grid, n)
    own = gan_passes(GANConfig(enabled=True), ms, 2)
    assert own == {"critic": (mp.AddedPass(2, layers, head(4)),), "actor": (mp.AddedPass(2, layers, head(2)),)}
    assert gan_passes(GANConfig(enabled=True, real_rows=1, fakes="separate"), ms, 2)["critic"] == \
        (mp.AddedPass(2, layers, head(2)),)
    assert gan_passes(GANConfig(enabled=True, noise=False, feature_layer=3), ms, 2)["critic"] == \
        (mp.AddedPass(4, 4, head(4)),)
    assert gan_passes(GANConfig(), ms, 2) == {}
    with pytest.raises(ConfigError, match="--dmd2-gan-real-rows 3: at most --micro-batch-size 2"):
        gan_passes(GANConfig(enabled=True, real_rows=3), ms, 2)

    kw = dict(tp=2, dp=1, micro=2, steps=5, denoise=4, bf16=True, recompute="selective", cp=2, sp=True)
    plain = mp.plan_cycle(ms, table(gan=True), **kw)
    gan = mp.plan_cycle(ms, table(gan=True), passes=own, **kw)
    for phase in ("critic", "actor"):
        (p,) = own[phase]
        assert gan.activations[phase] - plain.activations[phase] == \
            p.kept_bytes(ms, 2, True, "selective", cp=2, sp=True) > 0, phase
    assert gan.activations["rollout"] == plain.activations["rollout"] and gan.roles == plain.roles
    with pytest.raises(ValueError, match="only a phase with grad"):
        mp.plan_cycle(ms, table(gan=True), passes={"rollout": own["actor"]}, **kw)
    search = dict(world=8, gpus_per_node=8, budget=2 ** 50, micro=2, steps=5, denoise=4, bf16=True)
    found = [mp.search_layouts(ms, table(gan=True), passes=passes, **search) for passes in (None, own)]
    assert [f[0] for f in found[0]] == [f[0] for f in found[1]]  # at an unbounded budget: the same layouts
    for (layout, plain_plan, _, _), (_, gan_plan, _, _) in zip(*found):
        for phase in ("critic", "actor"):
            assert gan_plan.activations[phase] > plain_plan.activations[phase], (layout, phase)


def test_cli_plans_the_gan_passes(capsys):
    """launch/plan_memory.py --dmd2-gan: the critic and actor phases' activations are the plan's with the head's
    passes (`gan_passes` of the flags: fewer real rows, less), the rollout's unchanged; --dmd2-gan-real-rows above
    B refused in one line as the trainer refuses it."""
    row = ["--model-size", "wan2.1-1.3b", "--latent-shape", "16", "21", "60", "104", "--text-len", "512",
           "--micro-batch-size", "2", "--bf16", "--recompute-granularity", "selective"]
    ms = plan_memory.shape_from_args(plan_memory.parse_args(row))
    kw = dict(tp=1, dp=1, micro=2, steps=5, denoise=4, bf16=True, recompute="selective")
    cells = {}
    for extra in ([], ["--dmd2-gan"], ["--dmd2-gan", "--dmd2-gan-real-rows", "1"]):
        assert plan_memory.main(row + extra) == 0
        out = capsys.readouterr().out.splitlines()
        gan = plan_memory.parse_args(row + extra).run.gan
        want = mp.plan_cycle(ms, table(gan=gan.enabled), added=head_plan(gan, ms), passes=gan_passes(gan, ms, 2), **kw)
        for phase in mp.PHASES:
            line = next(x for x in out if x.startswith(f"{phase:8s} time-sliced"))
            assert line.split()[-4:-2] == plan_memory.fmt_bytes(want.activations[phase]).split(), (extra, phase)
        cells[len(extra)] = want.activations
    assert cells[0]["rollout"] == cells[1]["rollout"] == cells[3]["rollout"]
    for phase in ("critic", "actor"):
        assert cells[0][phase] < cells[1][phase]
    assert cells[3]["critic"] < cells[1]["critic"] and cells[3]["actor"] == cells[1]["actor"]
    assert plan_memory.main(row + ["--dmd2-gan", "--dmd2-gan-real-rows", "3"]) == 1
    assert "--dmd2-gan-real-rows 3: at most --micro-batch-size 2" in capsys.readouterr().err
