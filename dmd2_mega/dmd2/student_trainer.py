"""The DMD2 trainer behind `launch/pretrain_dmd2.py`: trains the student (and its critic) from a teacher.

One iteration = one cycle (`dmd2.cycle.run_cycle`, DESIGN section 2). Per DP rank, M = G / (B x DP)
micro-batches j (global index), each drawing K*B dataset conditions (and images, for the GAN head)
and three generators keyed (seed, cycle, j, stream) with streams ROLLOUT, CRITIC, ACTOR (`records`):
    rollout  (student, no grad)   K*B samples
    critic   K optimizer steps, step k on rows [kB, (k+1)B) of every rollout j; teacher CFG scores
    actor    one student optimizer step on the scored samples of every j
This module builds the roles (student and critic initialised from the teacher unless --student-load /
--critic-load; the critic is a `GANCritic` with --dmd2-gan), the micro-batch records, the LR schedules
and the EMA around the cycle, and runs `loop.train_loop`. Phases switch once per cycle; with
offload the roles a phase does not need sleep (`roles.PHASE_ROLES`): by default on CUDA only those the
memory plan says must (`memory_plan.choose_offload`). Host syncs: none
inside the cycle (a NaN/inf loss or grad norm skips that role's step on the device); one per cycle in
`loop.check_iteration` (skip counters: `--max-nan-iterations` consecutive skips of one role stop the run;
exit flags), and the log / eval / save intervals.
With --ema-decay the student's EMA is updated after each actor step and used by the eval unless --no-ema.
Checkpoints: dmd2/pair_checkpoint.py (student + EMA in --save, critic in <save>_critic, one commit).
"""
from __future__ import annotations

import contextlib
import os
import time
import uuid
from dataclasses import asdict, replace
from typing import Optional

import torch

from dmd2_mega.plan import memory_plan as mp
from dmd2_mega.train.builders import build_grads_and_optimizer, build_model, cast_model, data_info, enable_determinism
from dmd2_mega.train.checkpoint import RunState, check_writable, load_model_weights, load_payload, model_size_hint
from dmd2_mega.train.checkpoint_guard import check_family, check_role, check_save_dirs
from dmd2_mega.config import DistillConfig
from dmd2_mega.data import build_dataset
from dmd2_mega.data.loader import MicroBatchLoader
from dmd2_mega.data.sampler import GlobalBatchSampler
from dmd2_mega.dmd2.cycle import run_cycle
from dmd2_mega.dmd2.ema import StudentEMA
from dmd2_mega.dmd2.gan import GANCritic, holds_head, resolve_layer
from dmd2_mega.dmd2.pair_checkpoint import critic_dir, load_pair, save_pair
from dmd2_mega.dmd2.records import ACTOR, CRITIC, ROLLOUT, STOPS, CycleSettings, MicroBatch
from dmd2_mega.dmd2.roles import TRAINED_IN, Role, enter_phase
from dmd2_mega.errors import CheckpointError
from dmd2_mega.eval.data_metrics import metrics_for_data
from dmd2_mega.eval.grid import save_grid, save_video_grid
from dmd2_mega.eval.media import EvalMedia
from dmd2_mega.train.logger import TrainLogger, print_rank0
from dmd2_mega.train.loop import RunStateTrainer, train_loop
from dmd2_mega.megatron_import import fuser_state
from dmd2_mega.models import DataShape, count_parameters, get_size
from dmd2_mega.train.optim import LRSchedule
from dmd2_mega.distributed.parallel import all_reduce_mean, init_distributed, micro_batch_generator
from dmd2_mega.train.resilience import ExitController
from dmd2_mega.train.run_lock import lock_run_dirs
from dmd2_mega.sampling import eval_conditions, generate_student
from dmd2_mega.plan.throughput import PhaseClock, dmd2_cycle_flops, sample_flops

__all__ = ["DMD2Trainer", "critic_dir"]
ROLES = frozenset(("student", "critic", "teacher"))


class DMD2Trainer(RunStateTrainer):
    def __init__(self, cfg: DistillConfig):
        self.cfg = cfg
        t, d = cfg.train, cfg.dmd2
        start = time.time()
        if t.deterministic:
            enable_determinism()
        self.ps = ps = init_distributed(cfg.parallel, t.seed)
        self.num_micro_batches = t.resolve_batches(ps.dp_size)
        critic_save = t.save and critic_dir(t.save)
        t.check_paths_apart([("--save's critic directory", critic_save)])
        check_save_dirs([("--save", t.save, "student"), ("--save's critic directory", critic_save, "critic"),
                         ("--tensorboard-dir", t.tensorboard_dir, "log"), ("--loss-trace", t.loss_trace, "log")],
                        [("--teacher-load", d.teacher_load, "teacher"), ("--student-load", d.student_load, "student"),
                         ("--critic-load", d.critic_load, "critic")])
        if t.save:
            check_writable(t.save)
            check_writable(critic_dir(t.save))
            lock_run_dirs([("--save", t.save), ("--save (its critic directory)", critic_dir(t.save))], ps)
        self.dataset = build_dataset(t.data, "train")
        self.info = data_info(self.dataset)
        self.media = (EvalMedia(t.data, self.dataset, t.eval_prompts, t.vae, ps.is_main, ps.device)
                      if t.eval_interval else None)  # --eval-prompts / --vae checked before any training
        teacher_payload = load_payload(d.teacher_load, ps, flag="--teacher-load")
        if teacher_payload is None:
            raise CheckpointError(f"--teacher-load {d.teacher_load} holds no checkpoint "
                                  f"(no latest_checkpointed_iteration.txt)")
        check_role(teacher_payload, ("teacher", "student") if d.allow_student_teacher else ("teacher",),
                   "--teacher-load", d.teacher_load, "" if d.allow_student_teacher else
                   " (pass --allow-student-teacher to distill a distilled student)")
        self.family = get_size(cfg.model.size).family.name
        check_family(teacher_payload, self.family, "--teacher-load", d.teacher_load)
        saved_info = teacher_payload.get("data_info")  # None: converted from a public checkpoint (no data)
        if saved_info is not None and DataShape.from_info(saved_info) != DataShape.from_info(self.info):
            raise CheckpointError(f"--teacher-load {d.teacher_load} was trained on data {teacher_payload['data_info']} "
                                  f"but --data {t.data} is {self.info}")
        self.shape = DataShape.from_info(self.info).sample_shape
        self.settings = CycleSettings.from_config(cfg, self.shape, ps.device)
        student = self._build_model("student", teacher_payload)
        self.ema = StudentEMA(student, cfg.ema.decay, cfg.ema.start_iter) if cfg.ema.enabled else None
        self.offload, offload_note = self._offload_plan()
        self.roles = {"student": self._role("student", student, tuple(self.ema.tensors()) if self.ema else ()),
                      "critic": self._role("critic", self._build_model("critic", teacher_payload)),
                      "teacher": self._role("teacher", self._build_model("teacher", teacher_payload))}
        nparams = count_parameters(student, ps.tp_group, ps.device)
        print_rank0(f"> DMD2: {cfg.model.size} ({nparams:,} parameters per role, 3 roles); {ps.layout} "
                    f"megatron-jit={fuser_state()}; "
                    f"B={t.micro_batch_size} K={d.critic_steps_per_rollout} M={self.num_micro_batches}; student sigmas "
                    f"{[round(s, 4) for s in self.settings.student_sigmas.tolist()]}; scoring {d.critic_scoring}; "
                    f"teacher guidance {d.teacher_guidance_scale}{self._negative_note()}; "
                    f"offload {'+'.join(sorted(self.offload)) or 'none'} "
                    f"({offload_note}); {self._extras()}",
                    ps.rank)
        k, b = d.critic_steps_per_rollout, t.micro_batch_size
        per_sample = sample_flops(cfg.model.size, self.info, ps.tp_size, ps.cp_size, ps.rank)
        self.flops_per_iter = (dmd2_cycle_flops(per_sample, b, self.num_micro_batches, k,
                                                len(self.settings.student_sigmas), d.teacher_guidance_scale,
                                                d.critic_scoring) if per_sample else None)
        self.clock = PhaseClock(ps.device)
        self.sampler = GlobalBatchSampler(len(self.dataset), t.global_batch_size * k, b * k,
                                          ps.dp_rank, ps.dp_size, t.seed)
        self.batches = MicroBatchLoader(self.dataset, self.sampler, ps.device, t.num_workers,
                                        latents=self.settings.gan is not None)  # only the GAN head reads real samples
        self.state = RunState(pair_token=uuid.uuid4().hex)
        self.static = {"args": asdict(cfg), "data_info": self.info, "family": self.family,
                       "student_sigmas": self.settings.student_sigmas.tolist()}
        if t.load:
            self.load(t.load)
        self.exit = ExitController(t.exit_signal_handler, t.exit_duration_in_mins, ps.rank, ps.device, start)

    # ---- roles ---------------------------------------------------------------------------------
    def _build_model(self, name: str, teacher_payload: dict) -> torch.nn.Module:
        """The role's model with its init weights: --<name>-load, else the teacher's. With --dmd2-gan the
        critic is a GANCritic: a critic saved with its head loads whole, else the head is fresh."""
        cfg, ps, d = self.cfg, self.ps, self.cfg.dmd2
        model = build_model(cfg.model, self.info, ps, negative=self.dataset.negative)
        own = {"teacher": d.teacher_load, "student": d.student_load, "critic": d.critic_load}[name]
        source = own or d.teacher_load
        flag = f"--{name}-load {source}" if own else f"--teacher-load {source} (the {name}'s init)"
        payload = teacher_payload if source == d.teacher_load else load_payload(source, ps, flag=f"--{name}-load")
        if payload is None:
            raise CheckpointError(f"{flag} holds no checkpoint")
        if own and name != "teacher":  # an init of the student / critic: a teacher's, or one of its own role
            check_role(payload, ("teacher", name), f"--{name}-load", source)
        hint = model_size_hint(payload, cfg.model.size)
        if name == "critic" and cfg.gan.enabled:
            layer = resolve_layer(cfg.gan.feature_layer, model.num_feature_layers)
            if holds_head(payload["model"]):  # a --critic-load saved with its head
                model = GANCritic(model, layer, cfg.train.seed)
                load_model_weights(model, payload["model"], flag, hint)
            else:  # a fresh head on the loaded trunk
                load_model_weights(model, payload["model"], flag, hint)
                model = GANCritic(model, layer, cfg.train.seed)
        else:
            load_model_weights(model, payload["model"], flag, hint)
        return cast_model(model, cfg.optim.bf16)

    def _role(self, name: str, model: torch.nn.Module, extra: tuple = ()) -> Role:
        cfg, ps = self.cfg, self.ps
        if name == "teacher":
            model.requires_grad_(False)
            model.eval()
            role = Role(name, model)
        else:
            optim_cfg = cfg.optim if name == "student" else cfg.critic_optim()
            grads, optimizer = build_grads_and_optimizer(model, optim_cfg, ps)
            save = cfg.train.save if name == "student" else (critic_dir(cfg.train.save) if cfg.train.save else None)
            role = Role(name, model, optimizer,
                        LRSchedule(optim_cfg, cfg.train.train_iters), grads, save, extra)
        return role.with_offload(ps.device) if name in self.offload else role

    def _offload_plan(self) -> tuple[frozenset, str]:
        """(the roles that sleep in the phases that do not use them, why): the flags, else on CUDA the memory
        plan's cheapest set that fits memory_plan.PLAN_HEADROOM x --gpu-memory-gb (default the device's), else none."""
        d, t, ps, info = self.cfg.dmd2, self.cfg.train, self.ps, self.info
        if d.offload_inactive is not None:
            return (ROLES if d.offload_inactive else frozenset(),
                    "--offload-inactive" if d.offload_inactive else "--no-offload-inactive")
        if ps.device.type != "cuda":
            return frozenset(), "on a CPU there is no device memory to save"
        gib = d.gpu_memory_gb or torch.cuda.get_device_properties(ps.device).total_memory / 2**30
        ms = mp.model_shape_from_info(self.cfg.model.size, info)
        plan = mp.plan_cycle(ms, tp=ps.tp_size, dp=ps.dp_size, micro=t.micro_batch_size,
                             steps=d.critic_steps_per_rollout, denoise=len(self.settings.student_sigmas),
                             bf16=self.cfg.optim.bf16, recompute=self.cfg.model.recompute_granularity == "full",
                             guidance=d.teacher_guidance_scale, dist_opt=self.cfg.optim.use_distributed_optimizer,
                             cp=ps.cp_size, sp=ps.sequence_parallel)
        roles, totals, fits = mp.choose_offload(plan, mp.PLAN_HEADROOM * gib * 2**30, gan=self.cfg.gan.enabled)
        note = f"memory plan: phase peak {max(totals.values()) / 2**30:.1f} GiB of {gib:g} GiB"
        return roles, note + ("" if fits else "; OVER the budget even with every role offloaded")

    def _negative_note(self) -> str:
        """The null condition the teacher's CFG uses (none at guidance 1: no negative forward)."""
        g = self.cfg.dmd2.teacher_guidance_scale
        return f" (negative: {self.dataset.null_note})" if g != 1 else " (no negative forward)"

    def _extras(self) -> str:
        g, e = self.cfg.gan, self.cfg.ema
        noise = f"noise {list(self.cfg.gan_sigma_range())}" if g.noise else "clean"
        gan = (f"GAN head on block {self.roles['critic'].model.layer} (disc {g.disc_weight}, gen "
               f"{g.gen_weight}, {noise})" if g.enabled else "GAN off")
        return gan + (f"; student EMA {e.decay} from cycle {e.start_iter}" if self.ema else "; EMA off")

    # ---- checkpoints (dmd2/pair_checkpoint.py) -------------------------------------------------
    def save(self) -> None:
        self.state = save_pair(self.roles, replace(self.state, sampler=self.sampler.state_dict()), self.static,
                               self.ps, self.ema)

    def load(self, root: str) -> None:
        self.state = load_pair(self.roles, root, self.state, self.cfg, self.ps, self.ema,
                               self.static["student_sigmas"])
        if self.state.sampler is not None:
            self.sampler.load_state_dict(self.state.sampler)

    # ---- one cycle -----------------------------------------------------------------------------
    def micro_batches(self) -> list[MicroBatch]:
        """This rank's micro-batch records of the next cycle (advances the sampler)."""
        t, ps, it = self.cfg.train, self.ps, self.iteration
        n, gan = self.settings.critic_steps * self.settings.micro_batch_size, self.settings.gan is not None
        out = []
        for j, images, cond in self.batches.next_iteration():
            out.append(MicroBatch(
                index=j, cond=cond, sample_id_offset=(it * self.num_micro_batches * ps.dp_size + j) * n,
                rollout_gen=micro_batch_generator(t.seed, it, j, ps.device, stream=ROLLOUT),
                critic_gen=micro_batch_generator(t.seed, it, j, ps.device, stream=CRITIC),
                actor_gen=micro_batch_generator(t.seed, it, j, ps.device, stream=ACTOR) if gan else None,
                real=images,  # the GAN's real samples: these images
                stop_gen=micro_batch_generator(t.seed, it, j, torch.device("cpu"), stream=STOPS)))
        return out

    def cycle(self) -> dict:
        """One cycle with this iteration's learning rates, then the EMA update. Returns device-tensor metrics,
        the lr per phase, resident bytes per phase and the optimizer steps each trained role skipped (device
        tensors)."""
        trained = {name: self.roles[name] for name in TRAINED_IN.values()}
        lrs = {phase: trained[name].schedule.apply(trained[name].optimizer, self.iteration)
               for phase, name in TRAINED_IN.items()}
        skipped = {name: r.optimizer.skip_counters[0] for name, r in trained.items()}  # device tensors: no sync
        result = run_cycle(self.roles, self.micro_batches(), self.settings, hook=self.clock)
        self.clock.end_cycle()
        self.state = replace(self.state, iteration=self.iteration + 1)
        if self.ema is not None:
            self.ema.update(self.iteration)
        skipped = {name: r.optimizer.skip_counters[0] - skipped[name] for name, r in trained.items()}
        return {"metrics": result.metrics, "lr": lrs, "resident": result.resident, "skipped": skipped}

    # ---- evaluation ----------------------------------------------------------------------------
    def evaluate(self, out_dir: Optional[str]) -> Optional[dict]:
        t, ps = self.cfg.train, self.ps
        enter_phase("rollout", self.roles, self.settings.gan is not None)
        cond = (self.media.conditions(self.dataset, t.eval_num_samples) if self.media else
                eval_conditions(self.dataset, t.eval_num_samples))
        student = self.roles["student"].model
        use_ema = self.ema is not None and not self.cfg.ema.no_ema
        with self.ema.swapped_in(student) if use_ema else contextlib.nullcontext():
            images = generate_student(student, cond, self.settings.student_sigmas, shape=self.shape, seed=t.seed + 7,
                                      device=ps.device, dp_rank=ps.dp_rank, dp_size=ps.dp_size, dp_group=ps.dp_group)
        if not ps.is_main:
            return None
        result = {"weights": "EMA" if use_ema else "raw"}
        if out_dir:
            labels = cond if cond.dim() == 1 else None
            png = os.path.join(out_dir, "samples", f"cycle_{self.iteration:07d}.png")
            result["grid"] = (save_video_grid(images[:16], png) if images.dim() == 5 else
                              save_grid(images[:100], labels[:100] if labels is not None else None, png))
            media = self.media.write(images, out_dir, self.iteration) if self.media else None
            if media is not None:  # its GIFs / PNGs go to TensorBoard (logger.report_eval)
                result["media"] = media
        result.update(metrics_for_data(t.data, images, cond))
        return result

    # ---- the loop ------------------------------------------------------------------------------
    def train(self) -> dict:
        def step():
            out = self.cycle()
            optimizers = {name: self.roles[name].optimizer for name in out["skipped"]}
            return (self.iteration, out), optimizers, out["skipped"]

        return train_loop(self, step, "cycle", "DMD2")

    def log(self, logger: TrainLogger, pending: list) -> None:
        keys = list(pending[0][1]["metrics"])
        # the skip counts are equal on every DP rank, so the DP mean leaves them as they are
        stats = torch.stack([torch.stack([o["metrics"][k_].float() for k_ in keys]
                                         + [o["skipped"][name].float() for name in TRAINED_IN.values()])
                             for _, o in pending])
        stats = all_reduce_mean(stats.contiguous(), self.ps.dp_group)
        vals = stats.cpu().tolist()  # the one host sync per log interval
        per_iter = [dict(iteration=it, **dict(zip(keys, v))) for (it, _), v in zip(pending, vals)]
        last = pending[-1][1]
        metrics = {f"{phase}-lr": last["lr"][phase] for phase in TRAINED_IN}
        metrics.update({k_: sum(v[i] for v in vals) / len(vals) for i, k_ in enumerate(keys)})
        metrics.update({f"resident-MB-{p}": r / 2**20 for p, r in last["resident"].items()})
        metrics.update({f"{phase} nan iterations": int(round(sum(v[len(keys) + i] for v in vals)))
                        for i, phase in enumerate(TRAINED_IN)})
        metrics.update({f"{phase}-ms": 1000 * sec for phase, sec in self.clock.take().items()})
        metrics["_samples_per_iter"] = self.cfg.train.global_batch_size
        metrics["_flops_per_iter"] = self.flops_per_iter
        logger.log(self.iteration, self.sampler.consumed_samples, metrics, per_iter)
