"""DMD2's GAN head on the critic's intermediate features (tianweiy/DMD2's diffusion GAN), riding on the critic's
own flow-matching forward.

`GANCritic` is the critic role's model when `--dmd2-gan` is on: it owns the critic's trunk (any
family model, `models.family`) and the head, so the critic's optimizer, DDP, Sleeper and checkpoint
see both (state-dict keys `trunk.*` and `head.*`).
    features f = block l's output as its token grid [B, hidden, *grid] (l = `--dmd2-gan-feature-layer`, default
        the last block of the first half): `trunk.forward_features` gives them from the forward that also gives the
        velocity, `trunk.features` alone (the blocks after l are not run);
    head (`gan_heads.py`, --dmd2-gan-head): strided convolutions + GroupNorm + SiLU over the grid to one logit
        (tianweiy/DMD2's form; default) or the old token-mean MLP; replicated, initialised from generators keyed by
        --seed, so every TP, CP and DP rank starts identical (each holds the whole grid, hence identical head
        grads). Its own optimizer settings (`param_options`): lr x --dmd2-gan-head-lr-mult, weight decay
        --dmd2-gan-head-weight-decay on all its parameters, its gradient clipped apart to --dmd2-gan-head-clip-grad
        (tianweiy/DMD2's guidance AdamW: weight decay 0.01, clip 10).
`GANCritic.forward(x, sigma, cond)` is the trunk's velocity; with `extra=(x', sigma', cond')` it returns
(v, the head's logits on x from the same forward's features, the head's logits on x'; with `own=False`, where
all the fakes are in x', no head pass on x and None in its place), so that DDP sees the flow-matching and GAN terms
of a critic step in one call; the trunk runs x' in x's batch up to block l
(`FamilyModel.forward_features_and`: one pass of B + r rows, not a second small one). `logits(x, sigma, cond)` is
the head alone (the actor's frozen critic).
Inputs at a sigma of the GAN range (`--dmd2-gan-sigma-range`, default the score range; its grid points `choices`):
    fake (critic step k): the step's own flow-matching inputs x_s = (1 - sigma) x0hat + sigma eps, sigma ~ U{the
        step's grid}; the rows whose sigma lies in the GAN range count (weight 1, else 0). Given that, a row is
        x0hat noised to sigma ~ U{choices}, as a separately drawn input would be, and costs no forward of its own.
        `--dmd2-gan-fakes separate`: the x0hat of the step's first r rows (r = the reals' count) noised apart to
        sigma ~ U{choices} (drawn from the critic generator after the reals), in the reals' rows of the forward:
        as many fakes as reals, all counted, like tianweiy/DMD2's; r more rows through blocks 0..l per step.
    real: r dataset samples per critic step (--dmd2-gan-real-rows, default B: rows [kB, kB + r) of the micro-batch's
        K x B, each once per cycle, as many reals as fakes like tianweiy/DMD2's), noised to sigma ~ U{choices} with
        eps ~ N(0, I) from the critic generator after the flow-matching draws, inside the critic's forwards.
    `--no-dmd2-gan-noise`: fakes x0hat and reals at sigma 0 (clean), the fakes through a forward of their own.
Non-saturating losses on the logits D(.), w the fake rows' weights:
    discriminator (critic phase, every critic step, the critic's grad flows into trunk and head):
        L_D = sum_n w_n softplus(D(fake_n)) / max(sum_n w_n, 1) + mean(softplus(-D(real)))
        critic loss += disc_weight * L_D
    generator (actor phase, on the student's x0hat WITH grad, noised to sigma ~ U{choices} from the actor
    generator, critic frozen: only the student's parameters receive gradients):
        L_G = mean(softplus(-D(fake)))                                actor loss += gen_weight * L_G
d softplus(z) / dz = sigmoid(z).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from dmd2_mega import flow
from dmd2_mega.config import GANConfig
from dmd2_mega.errors import ConfigError
from dmd2_mega.methods.dmd2.gan_heads import build_head, head_kept_elements, head_parameters, head_tensors
from dmd2_mega.models import FamilyModel
from dmd2_mega.plan.memory_plan import AddedPass
from dmd2_mega.distributed.parallel import mark_whole_over_cp

HEAD_SEED_OFFSET = 9173  # the head's init generators are seeded with --seed + this


@dataclass(frozen=True)
class HeadOptions:
    """The head's kind and its own optimizer settings (--dmd2-gan-head*, `GANCritic.param_options`); the defaults
    are the flags'."""

    kind: str = GANConfig.head
    lr_mult: float = GANConfig.head_lr_mult
    weight_decay: float = GANConfig.head_weight_decay
    clip_grad: float = GANConfig.head_clip_grad


class GANCritic(FamilyModel):
    """The critic's trunk and its GAN head as one module (see the module docstring)."""

    def __init__(self, trunk: FamilyModel, layer: int, seed: int, head: HeadOptions = HeadOptions()):
        super().__init__()
        if not 0 <= layer < trunk.num_feature_layers:
            raise IndexError(f"GAN feature layer {layer} is outside the trunk's [0, {trunk.num_feature_layers - 1}]")
        self.trunk, self.layer, self.head_options = trunk, layer, head
        self.spec, self.num_feature_layers, self.feature_dim = trunk.spec, trunk.num_feature_layers, trunk.feature_dim
        self.feature_grid = trunk.feature_grid
        self.head = build_head(head.kind, trunk.feature_dim, trunk.feature_grid, seed + HEAD_SEED_OFFSET)
        self.head.to(next(trunk.parameters()).device)
        # the head reads a grid that every CP rank holds whole, so each CP rank's head gradient is the whole
        # gradient, not a part of it as for the trunk (models/token_parallel.py)
        mark_whole_over_cp(self.head.parameters(), getattr(getattr(trunk, "options", None), "context_parallel", 1) > 1)

    def forward(self, x: Tensor, sigma: Tensor, cond: Tensor, extra: Optional[tuple] = None, own: bool = True):
        """v [B, *shape]; with extra = (x', sigma', cond'): (v, logits [B] on x from this forward's features,
        logits [B'] on x'); with own=False the head runs on x' alone and the middle element is None (a caller
        whose fakes are all in x' spends no head pass on x)."""
        if extra is None:
            return self.trunk(x, sigma, cond)
        v, feats, extra_feats = self.trunk.forward_features_and(x, sigma, cond, self.layer, extra)
        if not own:
            return v, None, self.head(extra_feats)
        logits = self.head(torch.cat([feats, extra_feats]))
        return v, logits[:x.shape[0]], logits[x.shape[0]:]

    def param_options(self) -> dict:
        """The head's own optimizer settings (`train/optim.param_groups`): it starts from scratch while the trunk
        starts from the teacher, so its learning rate, weight decay and clip are its own (module docstring)."""
        o = self.head_options
        return {"head.": {"lr_mult": o.lr_mult, "weight_decay": o.weight_decay, "clip_grad": o.clip_grad}}

    def logits(self, x: Tensor, sigma: Tensor, cond: Tensor) -> Tensor:
        return self.head(self.trunk.features(x, sigma, cond, self.layer))

    def features(self, x: Tensor, sigma: Tensor, cond: Tensor, layer: int) -> Tensor:
        return self.trunk.features(x, sigma, cond, layer)

    def forward_features(self, x: Tensor, sigma: Tensor, cond: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        return self.trunk.forward_features(x, sigma, cond, layer)

    def forward_features_and(self, x: Tensor, sigma: Tensor, cond: Tensor, layer: int, extra: tuple):
        return self.trunk.forward_features_and(x, sigma, cond, layer, extra)

    def null_cond(self, n: int, device) -> Tensor:
        return self.trunk.null_cond(n, device)

    def negative_for(self, cond: Tensor) -> Tensor:
        return self.trunk.negative_for(cond)


def holds_head(state: dict) -> bool:
    """Whether a critic state dict was saved with its GAN head (a `GANCritic`)."""
    return any(k.startswith("head.") for k in state)


def saved_head_kind(state: dict) -> Optional[str]:
    """The kind of GAN head a critic state dict holds ("conv": `head.net.*`, "mlp": `head.mlp.*`), or None."""
    return next((kind for kind, prefix in (("conv", "head.net."), ("mlp", "head.mlp."))
                 if any(k.startswith(prefix) for k in state)), None)


def discriminator_loss(logits_fake: Tensor, logits_real: Tensor, fake_weight: Optional[Tensor] = None) -> Tensor:
    """mean softplus(D(fake)) + mean softplus(-D(real)); with `fake_weight` [B] (1: a fake row that counts, 0: one
    that does not) the fake mean is over the counted rows (0 when none counts)."""
    fake = F.softplus(logits_fake)
    return (fake.mean() if fake_weight is None else counted_mean(fake, fake_weight)) + F.softplus(-logits_real).mean()


def counted_mean(values: Tensor, weight: Tensor) -> Tensor:
    """The mean of `values` [B] over the rows of weight 1 (0 when none counts; no host sync)."""
    return (values * weight).sum() / weight.sum().clamp(min=1)


def generator_loss(logits_fake: Tensor) -> Tensor:
    return F.softplus(-logits_fake).mean()


def _no_head_hint(name: str, state: dict, gan: bool) -> str:
    if name != "critic" or gan == holds_head(state):
        return ""
    return (f" (the critic was saved {'without' if gan else 'with'} the GAN head; this run "
            f"{'has' if gan else 'has no'} --dmd2-gan)")


class NoGAN:
    """DMD2 without its GAN head: what `GANSettings` adds, as nothing (the critic's plain forward, no added loss,
    no added phase roles), so that the phases call the same members either way."""

    phase_needs: dict = {}
    reads_samples = False  # the micro-batches need not carry the dataset's samples
    frozen_critic = False  # the actor's backward reaches no other role

    def critic_forward(self, model, x_s: Tensor, sigma: Tensor, b, mb, k: int, size: int):
        """(v, added loss or None, {metric: detached device scalar})."""
        return model(x_s, sigma, b.cond).to(x_s.dtype), None, {}

    def actor_term(self, critic, x0hat: Tensor, gen, cond: Tensor):
        """(added loss or None, {metric: detached device scalar})."""
        return None, {}

    def init_model(self, name: str, model, state: dict, load):
        load(model, state)
        return model

    def load_hint(self, name: str, state: dict) -> str:
        return _no_head_hint(name, state, False)

    def describe(self, roles: dict) -> str:
        return "GAN off"


NO_GAN = NoGAN()


@dataclass(frozen=True)
class GANSettings:
    """The GAN head, DMD2's optional part: its settings and everything it adds to the method, in one place: the
    actor phase's need of the critic's weights (`phase_needs`), the critic role's model (`init_model`), the
    discriminator term of every critic step (`critic_forward`), the generator term of the actor step
    (`actor_term`), the dataset samples it reads, the start-up line and the resume hint.
    `choices` [n] fp32 are the GAN range's grid sigmas."""

    disc_weight: float
    gen_weight: float
    noise: bool
    choices: Tensor
    feature_layer: Optional[int] = None  # --dmd2-gan-feature-layer (None: the last block of the first half)
    seed: int = 0                        # --seed: the head's init generator
    sigma_range: tuple = ()              # the UNSHIFTED GAN range (the start-up line)
    real_rows: int = 0                   # r: real samples per critic step (0: B, every row's)
    fakes: str = GANConfig.fakes         # --dmd2-gan-fakes: own (the forward's rows in the range) or separate
    head: HeadOptions = HeadOptions()    # --dmd2-gan-head and the head's own lr multiplier, weight decay, clip

    # the actor's generator loss runs through the critic's trunk and head: its weights are resident then
    phase_needs: ClassVar[dict] = {"actor": {"critic": "weights"}}
    reads_samples: ClassVar[bool] = True  # the discriminator's real samples: the dataset's
    frozen_critic: ClassVar[bool] = True  # the actor's backward must give the critic's parameters no gradient

    def critic_forward(self, model, x_s: Tensor, sigma: Tensor, b, mb, k: int, size: int):
        """The critic's velocity at (x_s, sigma) and, from the same call, the discriminator term (module
        docstring): the fakes are this forward's own rows in the GAN range (with --no-dmd2-gan-noise, x0hat clean
        through a forward of their own), the reals rows [kB, kB + r) of the micro-batch's samples, noised with draws
        from the critic generator after the flow-matching ones:
        (v, disc_weight * L_D, {gan-disc-loss, gan-logit-gap, gan-fake-share})."""
        n, r = b.x0hat.shape[0], min(self.real_rows or size, size)
        real = mb.real[k * size:k * size + r].to(b.x0hat.dtype)
        if self.noise:
            x_r, sigma_r = gan_inputs(real, mb.critic_gen, self)
            if self.fakes == "separate":  # the first r rows' x0hat noised apart, after the reals' draws
                x_f, sigma_f = gan_inputs(b.x0hat[:r], mb.critic_gen, self)
                extra = (torch.cat([x_f, x_r]), torch.cat([sigma_f, sigma_r]), torch.cat([b.cond[:r], b.cond[:r]]))
                v, _, logits = model(x_s, sigma, b.cond, extra=extra, own=False)
                fake, real_logits, weight = logits[:r], logits[r:], torch.ones(r, device=x_s.device)
            else:
                v, fake, real_logits = model(x_s, sigma, b.cond, extra=(x_r, sigma_r, b.cond[:r]))
                weight = torch.isin(sigma, self.choices).float()  # the forward's rows the draw put in the GAN range
        else:
            clean = (torch.cat([b.x0hat, real]), torch.zeros(n + r, device=x_s.device), torch.cat([b.cond, b.cond[:r]]))
            v, _, logits = model(x_s, sigma, b.cond, extra=clean, own=False)
            fake, real_logits, weight = logits[:n], logits[n:], torch.ones(n, device=x_s.device)
        d_loss = discriminator_loss(fake, real_logits, weight)
        stats = {"gan-disc-loss": d_loss.detach(),  # mean D(real) - mean D(counted fake):
                 "gan-logit-gap": (real_logits.mean() - counted_mean(fake, weight)).detach(),
                 "gan-fake-share": weight.sum() / n}  # the fakes counted, as a share of the step's B rows
        return v.to(x_s.dtype), self.disc_weight * d_loss, stats

    def actor_term(self, critic, x0hat: Tensor, gen, cond: Tensor):
        """gen_weight * L_G on x0hat noised with draws from `gen` (the micro-batch's actor generator), through
        `critic` (a role whose model is a `GANCritic`, awake for its weights): (term, {actor-gan-loss})."""
        x_g, sigma_g = gan_inputs(x0hat, gen, self)
        g_loss = generator_loss(critic.model.logits(x_g, sigma_g, cond))
        return self.gen_weight * g_loss, {"actor-gan-loss": g_loss.detach()}

    def init_model(self, name: str, model, state: dict, load):
        """The critic is a `GANCritic`: one saved with its head loads whole, else a fresh head on the loaded trunk."""
        if name != "critic":
            load(model, state)
            return model
        layer = resolve_layer(self.feature_layer, model.num_feature_layers)
        if holds_head(state):  # a --critic-load saved with its head
            model = GANCritic(model, layer, self.seed, self.head)
            load(model, state)
            return model
        load(model, state)
        return GANCritic(model, layer, self.seed, self.head)

    def load_hint(self, name: str, state: dict) -> str:
        saved = saved_head_kind(state) if name == "critic" else None
        if saved is not None and saved != self.head.kind:
            return f" (the critic's GAN head was saved as --dmd2-gan-head {saved}; this run's is {self.head.kind})"
        return _no_head_hint(name, state, True)

    def describe(self, roles: dict) -> str:
        rng = list(self.sigma_range)
        fakes = ("fakes clean, a forward of their own" if not self.noise else
                 f"fakes: {self.real_rows} rows noised apart into {rng}" if self.fakes == "separate" else
                 f"fakes: the critic forward's rows in {rng}")
        h = self.head
        lr = f", lr x{h.lr_mult:g}" if h.lr_mult != 1.0 else ""
        head = f"{h.kind} head (weight decay {h.weight_decay:g}, clip {h.clip_grad:g}{lr})"
        return (f"GAN: {head} on block {roles['critic'].model.layer}'s token grid (disc {self.disc_weight}, gen "
                f"{self.gen_weight}; {fakes}; {self.real_rows} real per critic step)")


def gan_part(cfg, grid: Tensor) -> Optional[GANSettings]:
    """The GAN head of a `config.DistillConfig` run (None without --dmd2-gan); `grid` is the shifted critic grid
    on the compute device."""
    g, d, t = cfg.gan, cfg.dmd2, cfg.train
    if not g.enabled:
        return None
    gan_range = flow.critic_grid(d.critic_grid_size, t.timestep_shift, cfg.gan_sigma_range())[1]
    real_rows = resolve_real_rows(g, t.micro_batch_size)
    return GANSettings(g.disc_weight, g.gen_weight, g.noise, grid[gan_range.to(grid.device)], g.feature_layer,
                       t.seed, tuple(cfg.gan_sigma_range()), real_rows, g.fakes,
                       HeadOptions(g.head, g.head_lr_mult, g.head_weight_decay, g.head_clip_grad))


def head_plan(gan, ms) -> dict:
    """What the GAN head adds to the memory plan (`plan.memory_plan.plan_cycle`'s `added`): {"critic": (parameters,
    tensors)} of the head `gan` (a `config.GANConfig`) builds on the model shape `ms` (`memory_plan.ModelShape`:
    the trunk's hidden size over its token grid, as `GANCritic` builds it), {} without --dmd2-gan."""
    if not gan.enabled:
        return {}
    grid = ms.token_grid
    return {"critic": (head_parameters(gan.head, ms.spec.hidden_size, grid), head_tensors(gan.head, grid))}


def resolve_real_rows(gan, micro: int) -> int:
    """--dmd2-gan-real-rows of a `config.GANConfig` (default B = `micro`: each of the micro-batch's K x B samples
    once per cycle), checked against the micro-batch."""
    real_rows = gan.real_rows or micro
    if real_rows > micro:
        raise ConfigError(f"--dmd2-gan-real-rows {real_rows}: at most --micro-batch-size {micro} per critic step "
                          f"(step k reads rows [kB, kB + R) of the micro-batch's K x B samples; more would reuse the "
                          f"next step's)")
    return real_rows


def gan_passes(gan, ms, micro: int) -> dict:
    """What the GAN head adds to the activations of the memory plan (`plan.memory_plan.plan_cycle`'s `passes`) at
    micro-batch B = `micro`, {} without --dmd2-gan: {phase: (AddedPass,)}, each kept with the phase's own forward:
        critic: the reals (r rows, --dmd2-gan-real-rows, default B) through blocks 0..l, with --dmd2-gan-fakes
                separate r fakes too, with --no-dmd2-gan-noise the B clean fakes (`GANSettings.critic_forward`); the
                head on them, and on the forward's own B rows where those are the fakes (--dmd2-gan-fakes own);
        actor:  the generator term, the student's B samples through the frozen critic's blocks 0..l and its head
                (the student's gradient flows back through them: the same activations as a trained forward).
    l + 1 = --dmd2-gan-feature-layer + 1 blocks (`resolve_layer`); the head's share is `head_kept_elements` on the
    token grid `head_plan` reads. Measured with saved-tensor hooks in tests/test_plan_gan.py."""
    if not gan.enabled:
        return {}
    layers = resolve_layer(gan.feature_layer, ms.spec.num_layers) + 1
    grid = ms.token_grid
    reals = resolve_real_rows(gan, micro)
    rows = micro + reals if not gan.noise else reals if gan.fakes == "own" else 2 * reals

    def head(n: int) -> int:
        return head_kept_elements(gan.head, ms.spec.hidden_size, grid, n)
    own = gan.noise and gan.fakes == "own"  # the head also reads the forward's own rows
    return {"critic": (AddedPass(rows, layers, head(micro * own + rows)),),
            "actor": (AddedPass(micro, layers, head(micro)),)}


def resolve_layer(layer: int | None, num_layers: int) -> int:
    """--dmd2-gan-feature-layer (default (num_layers - 1) // 2, the last block of the first half: the head's real
    samples and the actor's generator term run half the critic), checked against the model."""
    layer = (num_layers - 1) // 2 if layer is None else layer
    if not 0 <= layer < num_layers:
        raise ConfigError(f"--dmd2-gan-feature-layer must be in [0, {num_layers - 1}] (the critic has "
                          f"{num_layers} blocks), got {layer}")
    return layer


def gan_inputs(x0: Tensor, gen: torch.Generator, gan: GANSettings) -> tuple[Tensor, Tensor]:
    """(x, sigma [B] fp32): x0 noised to sigma ~ U{choices} with eps drawn from `gen` (in that order),
    or x0 itself at sigma 0 with --no-dmd2-gan-noise (nothing drawn)."""
    n = x0.shape[0]
    if not gan.noise:
        return x0, torch.zeros(n, device=x0.device)
    x, sigma, _ = flow.noise_on_grid(x0, gen, gan.choices)
    return x, sigma
