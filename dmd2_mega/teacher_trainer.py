"""The teacher trainer behind `launch/pretrain_flow.py`: flow-matching pretraining of the teacher.

One iteration = one optimizer step on a global batch of G samples: each DP rank runs
M = G / (micro x DP) micro-batches, for each micro-batch j (global index) with noise from
`micro_batch_generator(seed, iteration, j)`:
    sigma = shift(u), u ~ U(0, 1);  x_s = (1 - sigma) x0 + sigma eps;  cond -> null w.p. p_drop
    loss_j = mean((v_theta(x_s, sigma, cond) - (eps - x0))^2)
and backpropagates loss_j / M into fp32 gradient buffers; their DP all-reduce (`grad_buffer.GradBuffer`)
averages over ranks, so the step's gradient is that of the mean loss over the global batch. Then TP-aware
clipping, AdamW, LR schedule. A NaN/inf loss or grad norm skips the step on the device; no host sync per
iteration: the loop's check points (log and save intervals, `loop.check_iteration`) read the skip counters
(`--max-nan-iterations` consecutive skips stop the run) and the exit flags, and the log/eval/save intervals sync.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, replace
from typing import Optional

import torch
import torch.nn.functional as F

from dmd2_mega import flow
from dmd2_mega.train.builders import build_grads_and_optimizer, build_model, cast_model, data_info, enable_determinism
from dmd2_mega.train.checkpoint import (RunState, check_writable, load_model_weights, load_optimizer_state, load_payload,
                                  model_size_hint, resumed, save_checkpoint, set_rng_state, training_payload)
from dmd2_mega.train.checkpoint_guard import (RESUME_SETTINGS, check_family, check_fresh_save, check_resume,
                                              check_role)
from dmd2_mega.config import FlowPretrainConfig
from dmd2_mega.data import build_dataset
from dmd2_mega.data.loader import MicroBatchLoader
from dmd2_mega.data.sampler import GlobalBatchSampler
from dmd2_mega.eval.media import EvalMedia
from dmd2_mega.eval.results import sample_results
from dmd2_mega.train.logger import TrainLogger, print_rank0
from dmd2_mega.megatron_import import fuser_state
from dmd2_mega.train.loop import RunStateTrainer, train_loop
from dmd2_mega.models import DataShape, compiled, count_parameters, get_size
from dmd2_mega.train.accumulate import MicroMean, per_micro
from dmd2_mega.train.optim import LRSchedule
from dmd2_mega.distributed.parallel import all_reduce_mean, init_distributed, micro_batch_generator
from dmd2_mega.train.resilience import ExitController
from dmd2_mega.train.run_lock import lock_run_dirs
from dmd2_mega.plan.throughput import flow_step_flops, sample_flops
from dmd2_mega.sampling import eval_conditions, generate


def flow_loss_micro(model, x0, cond, null_cond, gen, shift: float, cond_dropout: float):
    """Velocity flow-matching loss of one micro-batch (scalar fp32)."""
    b = x0.shape[0]
    sigma = flow.sample_train_sigma(b, shift, gen, device=x0.device)
    eps = torch.randn(x0.shape, generator=gen, device=x0.device, dtype=x0.dtype)
    if cond_dropout > 0:
        drop = torch.rand(b, generator=gen, device=x0.device) < cond_dropout
        cond = torch.where(drop.view(-1, *([1] * (cond.dim() - 1))), null_cond, cond)
    x_s = flow.add_noise(x0, eps, sigma)
    v = model(x_s, sigma, cond)
    return F.mse_loss(v.float(), flow.velocity_target(x0, eps).float())


class FlowTrainer(RunStateTrainer):
    def __init__(self, cfg: FlowPretrainConfig):
        self.cfg = cfg
        t = cfg.train
        start = time.time()
        if t.deterministic:
            enable_determinism()
        self.ps = ps = init_distributed(cfg.parallel, t.seed)
        self.num_micro_batches = t.resolve_batches(ps.dp_size)
        t.check_paths_apart()
        # a save folder holding checkpoints is written only by a resume from it (or --overwrite-save)
        overwrite_notes = check_fresh_save([("--save", t.save)], [t.load], t.overwrite_save)
        self.dataset = build_dataset(t.data, "train")
        self.info = data_info(self.dataset)
        self.family = get_size(cfg.model.size).family_name  # the tag its checkpoints record
        self.media = (EvalMedia(t.data, self.dataset, t.eval_prompts, t.vae, ps.is_main, ps.device)
                      if t.eval_interval else None)  # --eval-prompts / --vae checked before any training
        self.model = cast_model(build_model(cfg.model, self.info, ps, negative=self.dataset.negative), cfg.optim.bf16)
        nparams = count_parameters(self.model, ps.tp_group, ps.device)
        print_rank0(f"> model {cfg.model.size}: {nparams:,} parameters ({nparams / 1e9:.3f} B); "
                    f"{ps.layout} backend={ps.backend} device={ps.device} megatron-jit={fuser_state()}; compile "
                    f"{cfg.model.compile_choice(ps.device, ps.tp_size, ps.cp_size, ps.sequence_parallel)[1]}; "
                    f"attention {cfg.model.attention_choice(ps.device, cfg.optim.bf16)[1]}; "
                    f"global batch {t.global_batch_size} = micro {t.micro_batch_size} x DP {ps.dp_size} "
                    f"x {self.num_micro_batches} micro-batches; data {self.dataset!r}; condition dropout to "
                    f"{self.dataset.null_note}", ps.rank)
        self.grads, self.optimizer = build_grads_and_optimizer(self.model, cfg.optim, ps)
        per_sample = sample_flops(cfg.model.size, self.info, ps.tp_size, ps.cp_size, ps.rank)
        self.flops_per_iter = (flow_step_flops(per_sample, t.micro_batch_size, self.num_micro_batches)
                               if per_sample else None)
        self.schedule = LRSchedule(cfg.optim, t.train_iters)
        self.sampler = GlobalBatchSampler(len(self.dataset), t.global_batch_size, t.micro_batch_size,
                                          ps.dp_rank, ps.dp_size, t.seed)
        self.batches = MicroBatchLoader(self.dataset, self.sampler, ps.device, t.num_workers)
        self.state = RunState()
        if t.load:
            self.load(t.load)
        if t.save:  # every check passed: only now is anything created in --save (a failed start leaves nothing)
            check_writable(t.save)
            lock_run_dirs([("--save", t.save)], ps)
            for note in overwrite_notes:
                print_rank0(note, ps.rank)
        self.exit = ExitController(t.exit_signal_handler, t.exit_duration_in_mins, ps.rank, ps.device, start)

    # ---- checkpoints -------------------------------------------------------------------------
    def save(self) -> None:
        state = replace(self.state, sampler=self.sampler.state_dict())
        payload = training_payload(self.model, self.optimizer, self.schedule, state,
                                   {"args": asdict(self.cfg), "data_info": self.info, "role": "teacher",
                                    "family": self.family}, self.ps)
        path = save_checkpoint(self.cfg.train.save, self.iteration, payload, self.ps)
        self.state = replace(self.state, saved_iteration=self.iteration)
        print_rank0(f"> saved checkpoint at iteration {self.iteration} to {path}", self.ps.rank)

    def load(self, root: str) -> None:
        payload = load_payload(root, self.ps, missing_ok=self.cfg.train.load_is_save())
        if payload is None:
            print_rank0(f"> WARNING: no checkpoint in --load {root} yet; starting from scratch", self.ps.rank)
            return
        check_role(payload, ("teacher",), "--load", root, " (pretrain_flow.py resumes teachers only)")
        check_family(payload, self.family, "--load", root)
        if not self.cfg.train.no_load_optim:
            check_resume(payload, asdict(self.cfg), RESUME_SETTINGS, root)
        load_model_weights(self.model, payload["model"], f"--load {root}",
                           model_size_hint(payload, self.cfg.model.size))
        self.optimizer.sync_masters()  # the fp32 masters follow the loaded weights (a fresh optimizer keeps them)
        if self.cfg.train.no_load_optim:
            print_rank0(f"> loaded weights of iteration {payload['iteration']} from {root} (fresh optimizer)",
                        self.ps.rank)
            return
        load_optimizer_state(self.optimizer, self.schedule, payload, f"--load {root}", self.ps.tp_size,
                             self.cfg.optim.scheduler_from())
        self.sampler.load_state_dict(payload["sampler"])
        if not self.cfg.train.no_load_rng:
            set_rng_state(payload["rng"])
        self.state = resumed(self.state, payload, root, self.cfg.train.save)
        print_rank0(f"> resumed from {root} at iteration {self.iteration}", self.ps.rank)

    # ---- one optimizer step ------------------------------------------------------------------
    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        t, ps = self.cfg.train, self.ps
        lr = self.schedule.apply(self.optimizer, self.iteration)
        batches = self.batches.next_iteration()
        total = MicroMean(len(batches))
        for k, (j, x0, cond) in enumerate(batches):
            gen = micro_batch_generator(t.seed, self.iteration, j, ps.device)
            last = k == len(batches) - 1
            with contextlib.nullcontext() if last else self.grads.no_sync():
                # the dropped condition: CFG's negative of each sample (an I2V sample keeps its image)
                loss = flow_loss_micro(self.model, x0, cond, self.model.negative_for(cond), gen,
                                       t.timestep_shift, t.cond_dropout)
                per_micro(loss, len(batches)).backward()
            total.add(loss.detach())
        compiled.seal()  # the first step compiled the blocks' graphs: a later compilation is logged
        norm = self.optimizer.step(total.value)  # skipped (weights untouched) if the loss or the norm is non-finite
        self.optimizer.zero_grad()
        self.state = replace(self.state, iteration=self.iteration + 1)
        return total.value, norm, lr

    # ---- evaluation --------------------------------------------------------------------------
    def evaluate(self, out_dir: Optional[str]) -> Optional[dict]:
        t, ps = self.cfg.train, self.ps
        cond = (self.media.conditions(self.dataset, t.eval_num_samples) if self.media else
                eval_conditions(self.dataset, t.eval_num_samples))
        images = generate(self.model, cond, shape=DataShape.from_info(self.info).sample_shape,
                          steps=t.eval_steps, guidance=t.eval_guidance, shift=t.timestep_shift,
                          seed=t.seed + 7, device=ps.device, dp_rank=ps.dp_rank, dp_size=ps.dp_size,
                          dp_group=ps.dp_group, null_cond=self.media.negative(len(cond)) if self.media else None)
        if not ps.is_main:
            return None
        return sample_results(images, cond, out_dir, "iter", self.iteration, t.data, self.media)

    # ---- the loop ----------------------------------------------------------------------------
    def train(self) -> dict:
        def step():
            skipped_before = self.optimizer.skip_counters[0]  # device tensors: no sync
            loss, norm, lr = self.train_step()
            skipped = self.optimizer.skip_counters[0] - skipped_before
            return (self.iteration, loss, norm, lr, skipped), {"model": self.optimizer}, {"model": skipped}

        return train_loop(self, step, "iteration", "training")

    def log(self, logger: TrainLogger, pending: list) -> None:
        t, ps = self.cfg.train, self.ps
        stats = torch.stack([torch.stack([p[1].float(), p[2].float().to(p[1].device), p[4].float().to(p[1].device)])
                             for p in pending])
        stats[:, 0] = all_reduce_mean(stats[:, 0].contiguous(), ps.dp_group)
        vals = stats.cpu().tolist()  # the one host sync per log interval
        per_iter = [{"iteration": p[0], "loss": v[0], "grad_norm": v[1], "lr": p[3]} for p, v in zip(pending, vals)]
        ok = [v for v in vals if not v[2]] or vals  # averages leave skipped steps out
        logger.log(self.iteration, self.sampler.consumed_samples,
                   {"learning rate": pending[-1][3], "loss": sum(v[0] for v in ok) / len(ok),
                    "grad norm": sum(v[1] for v in ok) / len(ok),
                    "number of nan iterations": int(sum(v[2] for v in vals)),
                    "_samples_per_iter": t.global_batch_size,
                    "_flops_per_iter": self.flops_per_iter}, per_iter)
