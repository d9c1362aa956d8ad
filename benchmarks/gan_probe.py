"""Offline probe of DMD2's GAN heads (issue 54 item 4): can a head, alone, tell held-out reals from a trained student's
samples on a FROZEN critic's features, and does it stay at chance on two sets of reals?

    python benchmarks/gan_probe.py --run runs/q/student_1step [--layer L] [--sigma-range 0.05 0.3] \
        [--train-rows 1000] [--held-rows 400] [--draws 4] [--steps 600] [--batch 64] [--lrs 1e-4 1e-3] \
        [--heads conv mlp] [--seed 0] [--threads 8] [--json probe.json]

What it does (a script, not a unit test; tests/test_gan_probe.py checks its core on synthetic grids):
  1. loads the run's student (its EMA weights when saved, as launch/sample.py does) and its critic (<run>_critic; a
     critic saved as a `GANCritic` gives its trunk, the head it was trained with is dropped), frozen, eval mode;
  2. reals: --train-rows of the dataset's train split and up to --held-rows of its held-out split (a seeded choice
     of rows); fakes: the student's few-step samples (its saved grid) of class-balanced conditions, --train-rows
     with --seed and --held-rows with --seed + 1 (fresh noise);
  3. noises every sample --draws times, x_s = (1 - s) x0 + s eps with s ~ U{the GAN grid} (`flow.noise_on_grid`,
     one seeded generator per set), and caches the critic's block-`layer` token grids [N, draws, C, *grid] once
     (no grad, in chunks): every head and lr below trains and is scored on the same features;
  4. trains each head of --heads (`gan_heads.build_head`, fresh, seeded) for --steps AdamW steps on batches of
     --batch real + --batch fake cached rows (the same batches for every head) with the non-saturating
     L_D = mean softplus(D(fake)) + mean softplus(-D(real)) (`gan.discriminator_loss`): the conv head with the
     run's head settings (weight decay 0.01, clip 10: `gan.HeadOptions`, tianweiy/DMD2's guidance AdamW), the old
     mlp head as it was trained (weight decay 0 and the critic's clip 1: `config.OptimConfig`'s defaults);
  5. scores each on the held-out rows (every draw): L_D and the balanced accuracy (logit > 0 means real; the mean
     of the real and the fake rows' accuracies, so 0.5 is chance whatever the counts), also per half of the sigma
     range (low: unshifted s <= its midpoint);
  6. the control: train reals split in halves by row (A "real", B "fake"), scored on the held-out reals split in
     halves likewise: a head that separates them learns the sample, not real vs generated.
Chance: L_D = 2 ln 2 = 1.386, accuracy 0.5. What issue 54 asks of the conv head: held-out L_D <= 1.15 on real vs
student where the mlp head stays >= 1.35, and the control near chance for both.
The GAN grid is the run's (`flow.critic_grid` of its --dmd2-critic-grid-size, shifted by its --timestep-shift) over
--sigma-range (UNSHIFTED; default the run's GAN range, `config.DistillConfig.gan_sigma_range`: --dmd2-gan-sigma-range
or else the score range, when the run had --dmd2-gan; 0.05 0.3 (benchmarks/quality_ablation.py's) when it had not).
Prints a Markdown table (one row per pair x head x lr) under a header line naming the machine, torch, the run, the
layer, the grid and the row counts; `main(argv)` returns it all as a dict (--json OUT writes it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from dmd2_mega import flow  # noqa: E402
from dmd2_mega.config import DMD2Config, GANConfig, OptimConfig, ParallelConfig, saved_section  # noqa: E402
from dmd2_mega.errors import CheckpointError, ConfigError  # noqa: E402
from dmd2_mega.methods.dmd2.gan import HeadOptions, discriminator_loss, holds_head, resolve_layer  # noqa: E402
from dmd2_mega.methods.dmd2.gan_heads import HEADS, build_head  # noqa: E402

CHANCE_LOSS = 2 * math.log(2)
NO_GAN_RANGE = (0.05, 0.3)  # a run without --dmd2-gan: quality_ablation.py's GAN range
# the head's own AdamW: (weight decay, gradient clip); module docstring, step 4
HEAD_OPTIM = {"conv": (HeadOptions().weight_decay, HeadOptions().clip_grad),
              "mlp": (0.0, OptimConfig.clip_grad)}
SEED_OFFSETS = {"train-real": 11, "train-fake": 12, "held-real": 13, "held-fake": 14}  # the noise draws' generators


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, metavar="DIR",
                   help="a finished DMD2 run (launch/pretrain_dmd2.py --save DIR; its critic in DIR_critic)")
    p.add_argument("--iteration", type=int, default=None, help="default: the run's latest checkpoint")
    p.add_argument("--layer", type=int, default=None,
                   help="critic block whose token grid the heads read (default: the run's GAN layer, else the last "
                        "block of the first half)")
    p.add_argument("--sigma-range", type=float, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="UNSHIFTED noise range of the heads' inputs (default: the run's GAN range; 0.05 0.3 without)")
    p.add_argument("--train-rows", type=int, default=1000, help="real and fake samples to train on (each)")
    p.add_argument("--held-rows", type=int, default=400,
                   help="held-out real and fake samples (each; at most the held-out split's size)")
    p.add_argument("--draws", type=int, default=4, help="noise draws per sample")
    p.add_argument("--steps", type=int, default=600, help="AdamW steps per head and lr")
    p.add_argument("--batch", type=int, default=64, help="real rows and fake rows per step (each)")
    lr = p.add_mutually_exclusive_group()
    lr.add_argument("--lr", type=float, default=None, help="one learning rate (instead of --lrs)")
    lr.add_argument("--lrs", type=float, nargs="+", default=[1e-4, 1e-3], help="learning rates, each reported")
    p.add_argument("--heads", nargs="+", default=list(HEADS), choices=HEADS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--chunk", type=int, default=512, help="rows per critic forward while caching features")
    p.add_argument("--json", default=None, metavar="OUT", help="write the result dict as JSON")
    a = p.parse_args(argv)
    for flag, v in (("--train-rows", a.train_rows), ("--held-rows", a.held_rows), ("--draws", a.draws),
                    ("--steps", a.steps), ("--batch", a.batch), ("--chunk", a.chunk)):
        if v < 1:
            raise ConfigError(f"{flag} must be >= 1, got {v}")
    if a.train_rows < 2:
        raise ConfigError(f"--train-rows must be >= 2 (the control splits the train reals in halves), got "
                          f"{a.train_rows}")
    if a.sigma_range is not None and not 0.0 <= a.sigma_range[0] <= a.sigma_range[1] <= 1.0:
        raise ConfigError(f"--sigma-range needs 0 <= MIN <= MAX <= 1 (unshifted sigma), got {a.sigma_range}")
    a.lrs = [a.lr] if a.lr is not None else a.lrs
    if not all(math.isfinite(v) and v > 0 for v in a.lrs):
        raise ConfigError(f"--lr / --lrs must be finite and > 0, got {a.lrs}")
    return a


class Clock:
    """Progress lines: `> [  12.3 s] what`, the time since the probe started."""

    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self, what: str) -> None:
        print(f"> [{time.perf_counter() - self.start:7.1f} s] {what}", flush=True)


# ---- the core: heads on cached grids (tests/test_gan_probe.py) ----------------------------------------

def train_head(head: torch.nn.Module, real: Tensor, fake: Tensor, *, steps: int, batch: int, lr: float,
               weight_decay: float = 0.0, clip: float = 0.0, seed: int = 0) -> float:
    """Train `head` in place on grids real / fake [N, C, *grid] (any counts): `steps` AdamW steps, each on `batch`
    rows of each drawn with replacement from a generator seeded by `seed` (so every head sees the same batches), on
    `gan.discriminator_loss`; `clip` > 0 clips the gradient norm. Returns the mean L_D of the last tenth of the
    steps (one host sync, at the end)."""
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(seed)
    tail = max(1, steps // 10)
    losses = torch.zeros(tail, device=real.device)
    head.train()
    for step in range(steps):
        r = torch.randint(0, real.shape[0], (batch,), generator=gen).to(real.device)
        f = torch.randint(0, fake.shape[0], (batch,), generator=gen).to(fake.device)
        loss = discriminator_loss(head(fake[f]), head(real[r]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(head.parameters(), clip)
        opt.step()
        if step >= steps - tail:
            losses[step - (steps - tail)] = loss.detach()
    head.eval()
    return losses.mean().item()


@torch.no_grad()
def logits_of(head: torch.nn.Module, grids: Tensor, chunk: int = 1024) -> Tensor:
    """The head's logits [N] fp32 on grids [N, C, *grid], `chunk` rows at a time."""
    return torch.cat([head(grids[i:i + chunk]) for i in range(0, grids.shape[0], chunk)])


@torch.no_grad()
def evaluate(head: torch.nn.Module, real: Tensor, fake: Tensor) -> dict:
    """{loss: L_D (mean over each side), acc: balanced accuracy (logit > 0 means real), acc_real, acc_fake} of
    `head` on grids real / fake [N, C, *grid]; an empty side scores NaN (a sigma bucket the grid does not reach)."""
    if real.shape[0] == 0 or fake.shape[0] == 0:
        nan = float("nan")
        return {"loss": nan, "acc": nan, "acc_real": nan, "acc_fake": nan}
    was = head.training
    head.eval()
    lr_, lf = logits_of(head, real), logits_of(head, fake)
    head.train(was)
    acc_real, acc_fake = (lr_ > 0).float().mean().item(), (lf <= 0).float().mean().item()
    return {"loss": discriminator_loss(lf, lr_).item(), "acc": (acc_real + acc_fake) / 2, "acc_real": acc_real,
            "acc_fake": acc_fake}


def head_params(head: torch.nn.Module) -> int:
    return sum(p.numel() for p in head.parameters())


# ---- features of a run ----------------------------------------------------------------------------------

@dataclass
class Feats:
    """A set's cached critic features: grid [N, draws, C, *grid] fp32 and the sigma of each row [N, draws]."""

    grid: Tensor
    sigma: Tensor

    def rows(self, mask: Tensor | None = None) -> Tensor:
        """[N * draws, C, *grid], only the rows where `mask` [N, draws] is True when given."""
        g = self.grid.flatten(0, 1)
        return g if mask is None else g[mask.flatten()]

    def half(self, which: int) -> "Feats":
        """The first (0) or second (1) half of the samples (by row; the control's sets)."""
        n = self.grid.shape[0] // 2
        s = slice(0, n) if which == 0 else slice(n, None)
        return Feats(self.grid[s], self.sigma[s])


@torch.no_grad()
def cache_features(critic, x0: Tensor, cond: Tensor, choices: Tensor, layer: int, draws: int, seed: int,
                   chunk: int, device) -> Feats:
    """The critic's block-`layer` grids of x0 [N, *shape] noised `draws` times to sigma ~ U{choices}
    (`flow.noise_on_grid` from one CPU generator seeded by `seed`, draw by draw), `chunk` rows per forward."""
    gen = torch.Generator().manual_seed(seed)
    grids, sigmas = [], []
    for _ in range(draws):
        x_s, sigma, _ = flow.noise_on_grid(x0, gen, choices)
        out = [critic.features(x_s[i:i + chunk].to(device), sigma[i:i + chunk].to(device),
                               cond[i:i + chunk].to(device), layer).float()
               for i in range(0, x0.shape[0], chunk)]
        grids.append(torch.cat(out))
        sigmas.append(sigma.to(device))
    return Feats(torch.stack(grids, dim=1), torch.stack(sigmas, dim=1))


def gan_grid(args: dict, sigma_range) -> tuple[Tensor, tuple, str]:
    """(choices [G] fp32 shifted, the unshifted range, where the range came from) of the run's saved `args`."""
    gan, dmd2 = saved_section(GANConfig, args, "gan"), saved_section(DMD2Config, args, "dmd2")
    train = args.get("train") or {}
    if sigma_range is not None:
        rng, source = tuple(sigma_range), "--sigma-range"
    elif gan.enabled:
        rng = gan.input_range(dmd2)
        source = "the run's --dmd2-gan-sigma-range" if gan.sigma_range else "the run's score range"
    else:
        rng, source = NO_GAN_RANGE, "the run had no --dmd2-gan: quality_ablation.py's range"
    size, shift = dmd2.critic_grid_size, float(train.get("timestep_shift", 1.0))
    sigmas, in_range = flow.critic_grid(size, shift, rng)
    if not bool(in_range.any()):
        raise ConfigError(f"--sigma-range {rng[0]} {rng[1]} holds no point of the run's {size}-point critic grid")
    return sigmas[in_range], rng, f"{source}, {int(in_range.sum())} of {size} points, shift {shift:g}"


def load_run(run: str, iteration, ps):
    """(student payload, student model, its weights' words, frozen critic trunk) of a DMD2 run directory, through
    the loaders launch/sample.py and the trainer use."""
    from dmd2_mega.methods.pair_checkpoint import role_dir
    from dmd2_mega.sampling import check_checkpoint, load_sampling_model
    from dmd2_mega.train.builders import build_model
    from dmd2_mega.train.checkpoint import latest_iteration, load_model_weights, load_payload
    from dmd2_mega.train.lora_checkpoint import merged_payload
    from dmd2_mega.config import ModelConfig
    latest_iteration(run, "--run")  # a missing directory or a file is an error naming --run
    check_checkpoint(run, iteration)
    payload = load_payload(run, ps, iteration, flag="--run")
    if "student_sigmas" not in payload:
        raise CheckpointError(f"--run {run} holds no DMD2 student (no saved student grid): give the --save directory "
                              f"of launch/pretrain_dmd2.py")
    info = payload["data_info"]
    student, weights = load_sampling_model(payload, info, ps, source=f"--run {run}")
    cdir = role_dir(run, "critic")
    if not os.path.isdir(cdir):
        raise CheckpointError(f"--run {run}: its critic directory {cdir} is missing (a DMD2 run saves it beside the "
                              f"student)")
    critic_payload = load_payload(cdir, ps, int(payload["iteration"]), pair_id=payload.get("pair_id"),
                                  flag=f"--run {run} (critic)")
    if holds_head(critic_payload["model"]):  # a GANCritic: its trunk (the probe trains heads of its own)
        critic_payload = {**critic_payload,
                          **{k: {n[len("trunk."):]: v for n, v in critic_payload[k].items() if n.startswith("trunk.")}
                             for k in ("model", "partition_dims") if k in critic_payload}}
    critic_payload = merged_payload(critic_payload, ps, f"--run {run} (critic)")
    critic = build_model(ModelConfig.saved(payload["args"]).weights_only(), info, ps)
    load_model_weights(critic, critic_payload["model"], f"--run {cdir} (critic trunk)")
    critic.eval().requires_grad_(False)
    return payload, student, weights, critic


def samples(split_rows: int, want: int, seed: int) -> Tensor:
    """A seeded choice of min(want, split_rows) row indices of a split."""
    return torch.randperm(split_rows, generator=torch.Generator().manual_seed(seed))[:min(want, split_rows)]


def student_samples(student, sampler, n: int, seed: int, cond_of, shape, device) -> Tensor:
    """n student samples [n, *shape] (CPU, in [-1, 1]) from `sampling.sample_batches`, launch/sample.py's noise."""
    from dmd2_mega.sampling import sample_batches
    return torch.cat([x for _, x in sample_batches(student, sampler, n, cond_of, shape=shape, seed=seed,
                                                   batch_size=256, device=device)])


# ---- the probe --------------------------------------------------------------------------------------

def probe(pairs: dict, heads, lrs, *, channels: int, grid: tuple, steps: int, batch: int, seed: int, threshold,
          clock=None) -> list[dict]:
    """Every head x lr on every pair {name: (train real, train fake, held real, held fake) Feats}: one row each."""
    rows = []
    for pair, (tr, tf, hr, hf) in pairs.items():
        for kind in heads:
            wd, clip = HEAD_OPTIM[kind]
            for lr in lrs:
                t0 = time.perf_counter()
                head = build_head(kind, channels, grid, seed).to(tr.grid.device)
                train_loss = train_head(head, tr.rows(), tf.rows(), steps=steps, batch=batch, lr=lr,
                                        weight_decay=wd, clip=clip, seed=seed + 1)
                held = evaluate(head, hr.rows(), hf.rows())
                buckets = {name: evaluate(head, hr.rows(side(hr.sigma)), hf.rows(side(hf.sigma)))
                           for name, side in (("low", lambda s: s <= threshold), ("high", lambda s: s > threshold))}
                rows.append({"pair": pair, "head": kind, "lr": lr, "weight_decay": wd, "clip": clip,
                             "params": head_params(head), "steps": steps, "held_loss": held["loss"],
                             "held_acc": held["acc"], "held_acc_real": held["acc_real"],
                             "held_acc_fake": held["acc_fake"], "buckets": buckets, "train_loss": train_loss})
                if clock is not None:
                    clock(f"{pair}: {kind} head, lr {lr:g}: held-out L_D {held['loss']:.3f}, acc {held['acc']:.3f} "
                          f"({time.perf_counter() - t0:.1f} s)")
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| pair | head | lr | params | steps | held-out D loss | held-out acc | acc low / high sigma "
             "| train D loss (end) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["buckets"]
        lines.append(f"| {r['pair']} | {r['head']} | {r['lr']:g} | {r['params']:,} | {r['steps']} | "
                     f"{r['held_loss']:.3f} | {r['held_acc']:.3f} | {b['low']['acc']:.3f} / {b['high']['acc']:.3f} | "
                     f"{r['train_loss']:.3f} |")
    return "\n".join(lines)


def machine(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.machine()}, {os.cpu_count()} cores ({torch.get_num_threads()} torch threads)"


def main(argv=None) -> dict:
    """Run the probe (module docstring); returns {header: {...}, rows: [...], table: str}."""
    from dmd2_mega.data import build_dataset
    from dmd2_mega.distributed.parallel import destroy_distributed, init_distributed
    from dmd2_mega.models import DataShape
    from dmd2_mega.sampling import checkpoint_sampler, eval_conditions
    a = parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    clock = Clock()
    ps = init_distributed(ParallelConfig(), seed=a.seed)
    try:
        payload, student, weights, critic = load_run(a.run, a.iteration, ps)
        args, info, device = payload["args"], payload["data_info"], ps.device
        layer = resolve_layer(a.layer if a.layer is not None else saved_section(GANConfig, args, "gan").feature_layer,
                              critic.num_feature_layers)
        choices, rng, rng_note = gan_grid(args, a.sigma_range)
        threshold = flow.shift_sigma(sum(rng) / 2, float((args.get("train") or {}).get("timestep_shift", 1.0)))
        sampler = checkpoint_sampler(payload, None, 1.0, None)
        data = (args.get("train") or {}).get("data", "digits")
        train_set, held_set = build_dataset(data, "train"), build_dataset(data, "heldout")
        shape = DataShape.from_info(info).sample_shape
        clock(f"loaded --run {a.run} (cycle {payload['iteration']}): student ({weights}, {sampler.describe()}), "
              f"critic trunk frozen; data {data}: train {len(train_set)}, held-out {len(held_set)}")

        tr_idx = samples(len(train_set), a.train_rows, a.seed)
        hr_idx = samples(len(held_set), a.held_rows, a.seed + 1)
        n_train, n_held = len(tr_idx), len(hr_idx)
        x_tr, c_tr = train_set.get_batch(tr_idx)
        x_hr, c_hr = held_set.get_batch(hr_idx)

        def cond_of(lo, hi):  # class-balanced conditions, as launch/sample.py's
            return eval_conditions(train_set, hi - lo, lo)
        x_tf = student_samples(student, sampler, n_train, a.seed, cond_of, shape, device)
        x_hf = student_samples(student, sampler, n_held, a.seed + 1, cond_of, shape, device)
        c_tf, c_hf = cond_of(0, n_train), cond_of(0, n_held)
        clock(f"student samples: {n_train} train (seed {a.seed}) + {n_held} held-out (seed {a.seed + 1})")

        sets = {}
        for name, (x, c) in {"train-real": (x_tr, c_tr), "train-fake": (x_tf, c_tf), "held-real": (x_hr, c_hr),
                             "held-fake": (x_hf, c_hf)}.items():
            sets[name] = cache_features(critic, x, c, choices, layer, a.draws, a.seed + SEED_OFFSETS[name], a.chunk,
                                        device)
        grid, channels = tuple(critic.feature_grid), critic.feature_dim
        clock(f"features of block {layer} cached: {a.draws} draws x {n_train + n_train + n_held + n_held} samples, "
              f"grid [{critic.feature_dim}, {', '.join(map(str, grid))}]")
        del student, critic

        tr, tf, hr, hf = (sets[k] for k in ("train-real", "train-fake", "held-real", "held-fake"))
        pairs = {"real vs student": (tr, tf, hr, hf), "real vs real": (tr.half(0), tr.half(1), hr.half(0), hr.half(1))}
        rows = probe(pairs, a.heads, a.lrs, channels=channels, grid=grid, steps=a.steps,
                     batch=a.batch, seed=a.seed, threshold=threshold, clock=clock)
        held_note = "" if n_held == a.held_rows else f" (the held-out split holds {len(held_set)} < --held-rows)"
        header = {"machine": machine(device), "torch": torch.__version__, "run": os.path.abspath(a.run),
                  "iteration": int(payload["iteration"]), "student": f"{weights}, {sampler.describe()}",
                  "layer": layer, "sigma_range": list(rng), "sigma_grid": rng_note,
                  "sigmas": [round(float(s), 4) for s in (choices.max(), choices.min())],
                  "train_rows": n_train, "held_rows": n_held, "draws": a.draws, "batch": a.batch, "steps": a.steps,
                  "lrs": a.lrs, "seed": a.seed, "chance_loss": CHANCE_LOSS}
        text = (f"GAN head probe: {header['machine']}, torch {header['torch']}; run {header['run']} cycle "
                f"{header['iteration']} ({header['student']}); critic block {layer}'s token grid "
                f"[{channels}, {'x'.join(map(str, grid))}]; sigma unshifted {rng[0]:g}..{rng[1]:g} "
                f"({rng_note}; shifted {header['sigmas'][1]:g}..{header['sigmas'][0]:g}, low / high split at "
                f"{float(threshold):.3g}); rows {n_train} + {n_train} train, {n_held} + {n_held} held-out{held_note}, "
                f"x {a.draws} draws; batch {a.batch} + {a.batch}, {a.steps} steps; AdamW conv wd "
                f"{HEAD_OPTIM['conv'][0]:g} clip {HEAD_OPTIM['conv'][1]:g}, mlp wd {HEAD_OPTIM['mlp'][0]:g} clip "
                f"{HEAD_OPTIM['mlp'][1]:g}; chance D loss 2 ln 2 = {CHANCE_LOSS:.3f}, acc 0.5\n\n{table(rows)}")
        print("\n" + text, flush=True)
        result = {"header": header, "rows": rows, "table": text}
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f, indent=1)
        return result
    finally:
        destroy_distributed()


if __name__ == "__main__":
    from dmd2_mega.train.resilience import run_main
    sys.exit(run_main(lambda: main()))
