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
Checkpoints: student in --save, critic in <save>_critic (Megatron layout each), committed together:
both iteration directories are written, then the critic's tracker, then the student's (the commit
point); both payloads carry the same `pair_id`, and a load takes the critic saved with the student.
"""
from __future__ import annotations

import os
import time
import uuid
from dataclasses import asdict
from typing import Optional

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dmd2_mega.checkpoint import (CheckpointError, check_writable, commit, iter_dir, load_model_weights,
                                  load_payload, model_size_hint, partition_dims, rng_state, set_rng_state,
                                  write_iteration)
from dmd2_mega.config import ConfigError, DistillConfig, ModelConfig
from dmd2_mega.data import build_dataset
from dmd2_mega.data.sampler import GlobalBatchSampler
from dmd2_mega.dmd2.actor import actor_phase
from dmd2_mega.dmd2.critic import critic_grid, critic_phase
from dmd2_mega.dmd2.roles import Role, enter_phase
from dmd2_mega.dmd2.rollout import rollout, student_sigmas
from dmd2_mega.logger import TrainLogger, print_rank0
from dmd2_mega.loop import after_iteration, finish_run
from dmd2_mega.models import count_parameters
from dmd2_mega.offload import Sleeper
from dmd2_mega.optim import LRSchedule, build_optimizer
from dmd2_mega.parallel import all_reduce_mean, init_distributed, micro_batch_generator
from dmd2_mega.resilience import ExitController, account_skips
from dmd2_mega.training import build_model, cast_model, data_info, enable_determinism

ROLLOUT, CRITIC = 0, 1


def critic_dir(save: str) -> str:
    return save.rstrip("/") + "_critic"


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
        self.roles = {name: self._build_role(name, teacher_payload) for name in ("student", "critic", "teacher")}
        offload = d.offload_inactive if d.offload_inactive is not None else torch.cuda.is_available()
        if offload:
            for r in self.roles.values():
                r.sleeper = Sleeper(r.name, [r.model], [r.optimizer] if r.optimizer else [], device=ps.device)
        nparams = count_parameters(self.roles["student"].model, ps.tp_group)
        print_rank0(f"> DMD2: {cfg.model.size} ({nparams:,} parameters per role, 3 roles); TP={ps.tp_size} "
                    f"DP={ps.dp_size}; B={t.micro_batch_size} K={d.critic_steps_per_rollout} M={self.num_micro}; "
                    f"student sigmas {[round(s, 4) for s in self.sigmas.tolist()]}; scoring {d.critic_scoring}; "
                    f"teacher guidance {d.teacher_guidance_scale}; offload-inactive {offload}", ps.rank)
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
        load_model_weights(model, payload["model"], flag, model_size_hint(payload, cfg.model.size))
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

    # ---- checkpoints ---------------------------------------------------------------------------
    def _payload(self, role: Role) -> dict:
        return {"iteration": self.iteration, "model": role.model.state_dict(),
                "optimizer": role.optimizer.state_dict(), "scheduler": role.schedule.state_dict(),
                "sampler": self.sampler.state_dict(), "rng": rng_state(), "args": asdict(self.cfg),
                "data_info": self.info, "tp_size": self.ps.tp_size, "dp_size": self.ps.dp_size,
                "partition_dims": partition_dims(role.model), "role": role.name,
                "student_sigmas": self.sigmas.tolist(), "pair_id": f"{self.iteration}-{self.pair_token}",
                "checkpoint_version": 1}

    def save(self) -> None:
        """Both roles' iteration directories, then the critic's tracker, then the student's (the commit)."""
        for name in ("critic", "student"):
            role = self.roles[name]
            if role.sleeper is not None:
                role.sleeper.wake()
            write_iteration(role.save_dir, self.iteration, self._payload(role), self.ps)
        commit([self.roles["critic"].save_dir, self.roles["student"].save_dir], self.iteration, self.ps)
        self.saved_iteration = self.iteration
        print_rank0(f"> saved student to {self.cfg.train.save} and critic to {critic_dir(self.cfg.train.save)} "
                    f"at cycle {self.iteration}", self.ps.rank)

    def load(self, root: str) -> None:
        student = load_payload(root, self.ps)
        if student is None:
            print_rank0(f"> WARNING: no checkpoint in --load {root}; starting from --teacher-load", self.ps.rank)
            return
        cdir, n = critic_dir(root), int(student["iteration"])
        if not os.path.isdir(cdir):
            raise CheckpointError(f"--load {root}: the critic directory {cdir} is missing")
        if not any(os.path.isdir(iter_dir(cdir, n) + s_) for s_ in ("", ".old")):
            raise CheckpointError(f"--load {root}: the critic directory {cdir} holds no checkpoint of cycle {n} "
                                  f"(expected {iter_dir(cdir, n)}/, saved with the student of cycle {n})")
        critic = load_payload(cdir, self.ps, iteration=n, pair_id=student.get("pair_id"))
        t = self.cfg.train
        for name, payload in (("student", student), ("critic", critic)):
            role = self.roles[name]
            load_model_weights(role.model, payload["model"], f"--load {root} ({name})",
                               model_size_hint(payload, self.cfg.model.size))
            if t.no_load_optim:
                continue
            if payload["saved_tp_size"] != self.ps.tp_size:
                raise CheckpointError(f"--load {root} ({name}) was saved with --tensor-model-parallel-size "
                                      f"{payload['saved_tp_size']} but this run uses {self.ps.tp_size}: weights "
                                      f"reshard, optimizer state does not; pass --no-load-optim to continue from "
                                      f"the weights with fresh optimizers")
            role.optimizer.load_state_dict(payload["optimizer"])
            role.schedule.load_state_dict(payload["scheduler"])
        if t.no_load_optim:
            print_rank0(f"> loaded student and critic weights of cycle {student['iteration']} from {root} "
                        f"(fresh optimizers, cycle 0)", self.ps.rank)
            return
        self.sampler.load_state_dict(student["sampler"])
        if not self.cfg.train.no_load_rng:
            set_rng_state(student["rng"])
        self.iteration = int(student["iteration"])
        if t.save and os.path.abspath(root) == os.path.abspath(t.save):
            self.saved_iteration = self.iteration  # nothing new to save until the next cycle
        print_rank0(f"> resumed student and critic from {root} at cycle {self.iteration}", self.ps.rank)

    # ---- one cycle -----------------------------------------------------------------------------
    def cycle(self) -> dict:
        t, d, ps, roles = self.cfg.train, self.cfg.dmd2, self.ps, self.roles
        k, b = d.critic_steps_per_rollout, t.micro_batch_size
        lrs = {n: roles[n].schedule.apply(roles[n].optimizer, self.iteration) for n in ("student", "critic")}
        skipped = {n: roles[n].optimizer.skipped_steps for n in ("critic", "student")}
        shape = (self.info["in_channels"], self.info["image_size"], self.info["image_size"])
        resident = {"rollout": enter_phase("rollout", roles)}
        rollouts, critic_gens = [], []
        for j, idx in self.sampler.next_iteration():
            cond = self.dataset.get_batch(idx)[1].to(ps.device)
            gen = micro_batch_generator(t.seed, self.iteration, j, ps.device, stream=ROLLOUT)
            offset = (self.iteration * self.num_micro * ps.dp_size + j) * k * b
            rollouts.append(rollout(roles["student"].model, gen, k * b, cond, self.sigmas, shape=shape,
                                    device=ps.device, sample_id_offset=offset,
                                    max_batch=b if ps.device.type == "cpu" else None))
            critic_gens.append(micro_batch_generator(t.seed, self.iteration, j, ps.device, stream=CRITIC))
        resident["critic"] = enter_phase("critic", roles)
        null = roles["teacher"].model.null_cond
        scores, metrics = critic_phase(roles["critic"], roles["teacher"], rollouts, critic_gens, steps=k, micro=b,
                                       grid=self.grid, in_range=self.in_range, scoring=d.critic_scoring,
                                       loss_space=d.critic_loss_space, guidance=d.teacher_guidance_scale,
                                       null_cond=null)
        resident["actor"] = enter_phase("actor", roles)
        metrics.update(actor_phase(roles["student"], scores))
        self.iteration += 1
        skipped = {n: roles[n].optimizer.skipped_steps - k_ for n, k_ in skipped.items()}
        return {"metrics": metrics, "lr": lrs, "resident": resident, "skipped": skipped}

    # ---- evaluation ----------------------------------------------------------------------------
    def evaluate(self, out_dir: Optional[str]) -> Optional[dict]:
        from dmd2_mega.sampling import eval_conditions, generate_student
        t, ps = self.cfg.train, self.ps
        enter_phase("rollout", self.roles)
        cond = eval_conditions(self.dataset, t.eval_num_samples)
        shape = (self.info["in_channels"], self.info["image_size"], self.info["image_size"])
        images = generate_student(self.roles["student"].model, cond, self.sigmas, shape=shape, seed=t.seed + 7,
                                  device=ps.device, dp_rank=ps.dp_rank, dp_size=ps.dp_size, dp_group=ps.dp_group)
        if not ps.is_main:
            return None
        result = {}
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
        t, ps = self.cfg.train, self.ps
        logger = TrainLogger(ps.rank, t.train_iters, t.tensorboard_dir, t.loss_trace, self.iteration)
        pending, result, start = [], {}, time.time()
        try:
            while self.iteration < t.train_iters:
                out = self.cycle()
                pending.append((self.iteration, out))
                if self.iteration % t.log_interval == 0 or self.iteration == t.train_iters:
                    self._log(logger, pending)
                    pending = []
                account_skips({n: self.roles[n].optimizer for n in out["skipped"]}, out["skipped"],
                              t.max_nan_iterations, f"cycle {self.iteration}", ps.rank)  # may stop the run
                evaluated, stop = after_iteration(self, logger, "cycle", t.save or t.tensorboard_dir)
                result = result if evaluated is None else evaluated
                if stop:
                    break
            finish_run(self, logger, pending)
        finally:
            self.exit.close()
            logger.close()
        print_rank0(f"> DMD2 done: {self.iteration} cycles in {time.time() - start:.1f} s", ps.rank)
        return result

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
