"""The DMD2 cycle loop behind `launch/pretrain_dmd2.py` (DESIGN section 2).

One iteration = one cycle. Per DP rank, M = G / (B x DP) micro-batches j (global index), each:
    rollout  (student, no grad)   K*B samples, generator (seed, cycle, j, ROLLOUT)
    critic   K optimizer steps, step k on rows [kB, (k+1)B) of every rollout j, generator
             (seed, cycle, j, CRITIC); teacher CFG scores of the last step's samples
    actor    one student optimizer step on the scored samples of every j
Phases switch once per cycle; with --offload-inactive the roles a phase does not need sleep
(`roles.PHASE_ROLES`). Host syncs: one non-finite check per optimizer step (a NaN/inf loss or grad
norm skips that role's step; `--max-nan-iterations` consecutive skips of one role stop the run),
the exit check per cycle with `--exit-signal-handler` / `--exit-duration-in-mins`, and the log /
eval / save intervals.
With --dmd2-gan the critic carries a GAN head (dmd2/gan.py): each critic step adds the
discriminator loss on the student's x0hat vs the dataset images of the same micro-batch (stream
CRITIC), the actor adds the generator loss through the critic's frozen trunk (stream ACTOR), and the
actor phase keeps the critic's weights resident (`roles.GAN_PHASE_ROLES`). With --ema-decay the
student's EMA is updated after each actor step and used by the eval unless --no-ema.
Checkpoints: dmd2/checkpoints.py (student + EMA in --save, critic in <save>_critic, one commit).
"""
from __future__ import annotations

import contextlib
import os
import time
import uuid
from typing import Optional

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dmd2_mega.checkpoint import CheckpointError, check_writable, load_model_weights, load_payload, model_size_hint
from dmd2_mega.config import ConfigError, DistillConfig, ModelConfig
from dmd2_mega.data import build_dataset
from dmd2_mega.data.sampler import GlobalBatchSampler
from dmd2_mega.dmd2.actor import actor_phase
from dmd2_mega.dmd2.checkpoints import critic_dir, load_pair, save_pair
from dmd2_mega.dmd2.critic import critic_grid, critic_phase
from dmd2_mega.dmd2.ema import StudentEMA
from dmd2_mega.dmd2.gan import GANSettings, attach_head, resolve_layer
from dmd2_mega.dmd2.roles import Role, enter_phase
from dmd2_mega.dmd2.rollout import rollout, student_sigmas
from dmd2_mega.logger import TrainLogger, print_rank0
from dmd2_mega.loop import train_loop
from dmd2_mega.models import count_parameters
from dmd2_mega.offload import Sleeper
from dmd2_mega.optim import LRSchedule, build_optimizer
from dmd2_mega.parallel import all_reduce_mean, init_distributed, micro_batch_generator
from dmd2_mega.resilience import ExitController
from dmd2_mega.training import build_model, cast_model, data_info, enable_determinism

ROLLOUT, CRITIC, ACTOR = 0, 1, 2
__all__ = ["DMD2Trainer", "critic_dir", "validate_dmd2_args", "ROLLOUT", "CRITIC", "ACTOR"]


def validate_dmd2_args(cfg: DistillConfig, dp_size: int) -> int:
    """The checks that need the world size; returns micro-batches per rank (M)."""
    t, d = cfg.train, cfg.dmd2
    m = t.resolve_batches(dp_size)
    if d.critic_steps_per_rollout * t.micro_batch_size < 1:
        raise ConfigError("--dmd2-critic-steps-per-rollout x --micro-batch-size must be >= 1")
    return m


class DMD2Trainer:
    def __init__(self, cfg: DistillConfig):
        self.cfg = cfg
        t, d = cfg.train, cfg.dmd2
        start = time.time()
        if t.deterministic:
            enable_determinism()
        self.ps = ps = init_distributed(cfg.parallel, t.seed)
        self.num_micro = validate_dmd2_args(cfg, ps.dp_size)
        if t.save:
            check_writable(t.save)
            check_writable(critic_dir(t.save))
        self.dataset = build_dataset(t.data, "train")
        self.info = data_info(self.dataset)
        teacher_payload = load_payload(d.teacher_load, ps)
        if teacher_payload is None:
            raise CheckpointError(f"--teacher-load {d.teacher_load} holds no checkpoint "
                                  f"(no latest_checkpointed_iteration.txt)")
        if teacher_payload["data_info"] != self.info:
            raise CheckpointError(f"--teacher-load {d.teacher_load} was trained on data {teacher_payload['data_info']} "
                                  f"but --data {t.data} is {self.info}")
        self.sigmas = student_sigmas(d.denoising_steps if d.student_sigmas is None else len(d.student_sigmas),
                                     d.student_sigmas, t.timestep_shift).to(ps.device)
        grid, in_range = critic_grid(d.critic_grid_size, t.timestep_shift, d.score_sigma_range)
        self.grid, self.in_range = grid.to(ps.device), in_range.to(ps.device)
        self.gan = None
        if d.gan:  # the head's input noise: grid points in --dmd2-gan-sigma-range (default the score range)
            gan_mask = critic_grid(d.critic_grid_size, t.timestep_shift, d.gan_sigma_range or d.score_sigma_range)[1]
            self.gan = GANSettings(d.gan_disc_weight, d.gan_gen_weight, d.gan_noise, self.grid[gan_mask.to(ps.device)])
        self.roles = {name: self._build_role(name, teacher_payload) for name in ("student", "critic", "teacher")}
        student = self.roles["student"].model
        self.ema = StudentEMA(student, d.ema_decay, d.ema_start_iter) if d.ema_decay > 0 else None
        offload = d.offload_inactive if d.offload_inactive is not None else torch.cuda.is_available()
        if self.ema is not None:
            self.roles["student"].extra = self.ema.tensors()
        if offload:
            for r in self.roles.values():
                r.sleeper = Sleeper(r.name, [r.model], [r.optimizer] if r.optimizer else [], r.extra, device=ps.device)
        nparams = count_parameters(self.roles["student"].model, ps.tp_group)
        print_rank0(f"> DMD2: {cfg.model.size} ({nparams:,} parameters per role, 3 roles); TP={ps.tp_size} "
                    f"DP={ps.dp_size}; B={t.micro_batch_size} K={d.critic_steps_per_rollout} M={self.num_micro}; "
                    f"student sigmas {[round(s, 4) for s in self.sigmas.tolist()]}; scoring {d.critic_scoring}; "
                    f"teacher guidance {d.teacher_guidance_scale}; offload-inactive {offload}; {self._extras()}",
                    ps.rank)
        k, b = d.critic_steps_per_rollout, t.micro_batch_size
        self.sampler = GlobalBatchSampler(len(self.dataset), t.global_batch_size * k, b * k,
                                          ps.dp_rank, ps.dp_size, t.seed)
        self.iteration = 0
        self.saved_iteration: Optional[int] = None  # the cycle --save holds from this process
        self.pair_token = uuid.uuid4().hex  # with the cycle, ties a student save to its critic save
        if t.load:
            self.load(t.load)
        self.exit = ExitController(t.exit_signal_handler, t.exit_duration_in_mins, ps.rank, ps.device, start)

    # ---- roles ---------------------------------------------------------------------------------
    def _build_role(self, name: str, teacher_payload: dict) -> Role:
        cfg, ps, d = self.cfg, self.ps, self.cfg.dmd2
        model = build_model(cfg.model, self.info, ps)
        own = {"teacher": d.teacher_load, "student": d.student_load, "critic": d.critic_load}[name]
        source = own or d.teacher_load
        flag = f"--{name}-load {source}" if own else f"--teacher-load {source} (the {name}'s init)"
        payload = teacher_payload if source == d.teacher_load else load_payload(source, ps)
        if payload is None:
            raise CheckpointError(f"{flag} holds no checkpoint")
        head_saved = any(k.startswith("gan_head.") for k in payload["model"])
        if name == "critic" and d.gan and head_saved:  # a --critic-load saved with its head
            attach_head(model, resolve_layer(d.gan_feature_layer, len(model.blocks)), cfg.train.seed)
        load_model_weights(model, payload["model"], flag, model_size_hint(payload, cfg.model.size))
        if name == "critic" and d.gan and not head_saved:  # a fresh head on the teacher's trunk
            attach_head(model, resolve_layer(d.gan_feature_layer, len(model.blocks)), cfg.train.seed)
        model = cast_model(model, cfg.optim.bf16)
        if name == "teacher":
            model.requires_grad_(False)
            model.eval()
            return Role(name, model)
        optim_cfg = cfg.optim if name == "student" else cfg.critic_optim()
        ddp = DDP(model, process_group=ps.dp_group, broadcast_buffers=False) if ps.dp_size > 1 else None
        save = cfg.train.save if name == "student" else (critic_dir(cfg.train.save) if cfg.train.save else None)
        return Role(name, model, build_optimizer(model, optim_cfg, ps.tp_group, ps.dp_group),
                    LRSchedule(optim_cfg, cfg.train.train_iters), ddp, save)

    def _extras(self) -> str:
        d = self.cfg.dmd2
        noise = f"noise {list(d.gan_sigma_range or d.score_sigma_range)}" if d.gan_noise else "clean"
        gan = (f"GAN head on block {self.roles['critic'].model.gan_layer} (disc {d.gan_disc_weight}, gen "
               f"{d.gan_gen_weight}, {noise})" if d.gan else "GAN off")
        return gan + (f"; student EMA {d.ema_decay} from cycle {d.ema_start_iter}" if self.ema else "; EMA off")

    # ---- checkpoints (dmd2/checkpoints.py) -----------------------------------------------------
    def save(self) -> None:
        save_pair(self)

    def load(self, root: str) -> None:
        load_pair(self, root)

    # ---- one cycle -----------------------------------------------------------------------------
    def cycle(self) -> dict:
        t, d, ps, roles = self.cfg.train, self.cfg.dmd2, self.ps, self.roles
        k, b = d.critic_steps_per_rollout, t.micro_batch_size
        lrs = {n: roles[n].schedule.apply(roles[n].optimizer, self.iteration) for n in ("student", "critic")}
        skipped = {n: roles[n].optimizer.skipped_steps for n in ("critic", "student")}
        shape = (self.info["in_channels"], self.info["image_size"], self.info["image_size"])
        gan = self.gan is not None
        resident = {"rollout": enter_phase("rollout", roles, gan)}
        rollouts, critic_gens, reals, actor_gens = [], [], [], []
        for j, idx in self.sampler.next_iteration():
            images, cond = self.dataset.get_batch(idx)
            cond = cond.to(ps.device)
            gen = micro_batch_generator(t.seed, self.iteration, j, ps.device, stream=ROLLOUT)
            offset = (self.iteration * self.num_micro * ps.dp_size + j) * k * b
            rollouts.append(rollout(roles["student"].model, gen, k * b, cond, self.sigmas, shape=shape,
                                    device=ps.device, sample_id_offset=offset,
                                    max_batch=b if ps.device.type == "cpu" else None))
            critic_gens.append(micro_batch_generator(t.seed, self.iteration, j, ps.device, stream=CRITIC))
            if gan:  # the real samples of the GAN are this micro-batch's dataset images
                reals.append(images.to(ps.device))
                actor_gens.append(micro_batch_generator(t.seed, self.iteration, j, ps.device, stream=ACTOR))
        resident["critic"] = enter_phase("critic", roles, gan)
        null = roles["teacher"].model.null_cond
        scores, metrics = critic_phase(roles["critic"], roles["teacher"], rollouts, critic_gens, steps=k, micro=b,
                                       grid=self.grid, in_range=self.in_range, scoring=d.critic_scoring,
                                       loss_space=d.critic_loss_space, guidance=d.teacher_guidance_scale,
                                       null_cond=null, gan=self.gan, reals=reals)
        resident["actor"] = enter_phase("actor", roles, gan)
        metrics.update(actor_phase(roles["student"], scores, self.gan, roles["critic"], actor_gens))
        self.iteration += 1
        if self.ema is not None:
            self.ema.update(self.iteration)
        skipped = {n: roles[n].optimizer.skipped_steps - k_ for n, k_ in skipped.items()}
        return {"metrics": metrics, "lr": lrs, "resident": resident, "skipped": skipped}

    # ---- evaluation ----------------------------------------------------------------------------
    def evaluate(self, out_dir: Optional[str]) -> Optional[dict]:
        from dmd2_mega.sampling import eval_conditions, generate_student
        t, ps = self.cfg.train, self.ps
        enter_phase("rollout", self.roles, self.gan is not None)
        cond = eval_conditions(self.dataset, t.eval_num_samples)
        shape = (self.info["in_channels"], self.info["image_size"], self.info["image_size"])
        student = self.roles["student"].model
        use_ema = self.ema is not None and not self.cfg.dmd2.no_ema
        with self.ema.swapped_in(student) if use_ema else contextlib.nullcontext():
            images = generate_student(student, cond, self.sigmas, shape=shape, seed=t.seed + 7, device=ps.device,
                                      dp_rank=ps.dp_rank, dp_size=ps.dp_size, dp_group=ps.dp_group)
        if not ps.is_main:
            return None
        result = {"weights": "EMA" if use_ema else "raw"}
        if out_dir:
            from dmd2_mega.eval.grid import save_grid
            labels = cond if cond.dim() == 1 else None
            result["grid"] = save_grid(images[:100], labels[:100] if labels is not None else None,
                                       os.path.join(out_dir, "samples", f"cycle_{self.iteration:07d}.png"))
        if t.data == "digits":
            from dmd2_mega.eval.digits import evaluate_digits
            result.update(evaluate_digits(images, cond))
        return result

    # ---- the loop ------------------------------------------------------------------------------
    def train(self) -> dict:
        def step():
            out = self.cycle()
            return (self.iteration, out), {n: self.roles[n].optimizer for n in out["skipped"]}, out["skipped"]

        return train_loop(self, step, "cycle", "DMD2")

    def _log(self, logger: TrainLogger, pending: list) -> None:
        keys = list(pending[0][1]["metrics"])
        stats = torch.stack([torch.stack([o["metrics"][k_].float() for k_ in keys]) for _, o in pending])
        stats = all_reduce_mean(stats.contiguous(), self.ps.dp_group)
        vals = stats.cpu().tolist()  # the one host sync per log interval
        per_iter = [dict(iteration=it, **dict(zip(keys, v))) for (it, _), v in zip(pending, vals)]
        last = pending[-1][1]
        metrics = {"critic-lr": last["lr"]["critic"], "actor-lr": last["lr"]["student"]}
        metrics.update({k_: sum(v[i] for v in vals) / len(vals) for i, k_ in enumerate(keys)})
        metrics.update({f"resident-MB-{p}": r / 2**20 for p, r in last["resident"].items()})
        metrics.update({f"{'actor' if n == 'student' else n} nan iterations": sum(o["skipped"][n] for _, o in pending)
                        for n in ("critic", "student")})
        metrics["_samples_per_iter"] = self.cfg.train.global_batch_size
        logger.log(self.iteration, self.sampler.consumed_samples, metrics, per_iter)
