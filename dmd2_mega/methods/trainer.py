"""The student trainer every method shares: trains a few-step student (and the method's other trained roles)
from a teacher, running one method's cycle per iteration (`base.Method`; DMD2: `methods.dmd2.method.DMD2Trainer`,
behind `launch/pretrain_dmd2.py`).

`StudentTrainer(cfg, build)`: `build(cfg, shape, device)` makes the method once the data shape is known; the
method's class attributes `roles` (every role, in build order) and `trained` (the roles with an optimizer, the
student last: the save order) are read before, for the directory checks. Per DP rank, M = G / (B x DP)
micro-batches j (global index), each drawing F*B dataset conditions (F = the method's `data_factor`; DMD2:
K) and, if the method reads them, their samples, with four generators keyed (seed, cycle, j, stream), streams
ROLLOUT, CRITIC, ACTOR, STOPS (`base.MicroBatch`). This module builds the roles (every role initialised from
the teacher unless --<role>-load; the method may wrap a role's model: DMD2's GAN head), the micro-batch
records, the LR schedules and the EMA around the cycle, and runs `loop.train_loop`. With offload the roles a
phase of the method's table does not need sleep: by default on CUDA only those the method's memory plan says
must. Host syncs: none inside the cycle (a NaN/inf loss or grad norm skips that role's step on the device) and
none per cycle in the loop: the skip counters (`--max-nan-iterations` consecutive skips of one role stop the run)
and, with several ranks, the exit flags are read at the loop's check points, the log and save intervals
(`loop.check_iteration`); the log / eval / save intervals sync. The micro-batch generators are made once per run,
one per (micro-batch index, stream), and re-seeded each cycle with its keyed seed
(`parallel.micro_batch_generator(..., generator=)`): the draws of new generators, without new objects.
With --ema-decay the student's EMA is updated after each cycle and used by the eval unless --no-ema.
Checkpoints: `pair_checkpoint` (student + EMA in --save, each other trained role in <save>_<role>, one commit).
"""
from __future__ import annotations

import contextlib
import os
import time
import uuid
import zlib
from dataclasses import asdict, replace
from typing import Optional

import torch

from dmd2_mega.config import DistillConfig
from dmd2_mega.data import build_dataset
from dmd2_mega.data.loader import MicroBatchLoader
from dmd2_mega.data.sampler import GlobalBatchSampler
from dmd2_mega.data.trajectories import TrajectoryDataset
from dmd2_mega.models import compiled, cuda_graphs
from dmd2_mega.distributed.parallel import all_reduce_mean, init_distributed, micro_batch_generator
from dmd2_mega.errors import CheckpointError, ConfigError
from dmd2_mega.eval.media import EvalMedia
from dmd2_mega.eval.results import sample_results
from dmd2_mega.megatron_import import fuser_state
from dmd2_mega.methods.base import ACTOR, CRITIC, ROLLOUT, STOPS, MethodBuilder, MicroBatch, trained_in
from dmd2_mega.methods.ema import StudentEMA
from dmd2_mega.methods.pair_checkpoint import load_pair, role_dir, save_pair
from dmd2_mega.methods.roles import Role, enter_phase, set_prefetch
from dmd2_mega.models import DataShape, count_parameters, get_size
from dmd2_mega.models.lora import adapt
from dmd2_mega.plan.memory_plan import PLAN_HEADROOM
from dmd2_mega.plan.throughput import PhaseClock, sample_flops
from dmd2_mega.sampling import eval_conditions, generate_student
from dmd2_mega.train.builders import build_grads_and_optimizer, build_model, cast_model, data_info, enable_determinism
from dmd2_mega.train.checkpoint import RunState, check_writable, load_model_weights, load_payload, model_size_hint
from dmd2_mega.train.checkpoint_guard import check_family, check_fresh_save, check_role, check_save_dirs
from dmd2_mega.train.flat import flatten_parameters
from dmd2_mega.train import memory_record
from dmd2_mega.train.lora_checkpoint import merged_payload, state_fingerprint
from dmd2_mega.train.logger import TrainLogger, print_rank0
from dmd2_mega.train.loop import RunStateTrainer, train_loop
from dmd2_mega.train.optim import LRSchedule
from dmd2_mega.train.resilience import ExitController
from dmd2_mega.train.run_lock import lock_run_dirs

__all__ = ["StudentTrainer"]


class StudentTrainer(RunStateTrainer):
    def __init__(self, cfg: DistillConfig, build: MethodBuilder):
        self.cfg = cfg
        t, d = cfg.train, cfg.dmd2
        start = time.time()
        if t.deterministic:
            enable_determinism()
        self.ps = ps = init_distributed(cfg.parallel, t.seed)
        self.num_micro_batches = t.resolve_batches(ps.dp_size)
        self.role_names, self.trained = tuple(build.roles), tuple(build.trained)
        d.offload_set(self.role_names)  # ConfigError for an --offload-roles name the method lacks, before any I/O
        others = [name for name in self.trained if name != "student"]  # saved in <save>_<role>
        dirs = [(f"--save's {name} directory", t.save and role_dir(t.save, name), name) for name in others]
        t.check_paths_apart([(what, path) for what, path, _ in dirs])
        check_save_dirs([("--save", t.save, "student"), *dirs,
                         ("--tensorboard-dir", t.tensorboard_dir, "log"), ("--loss-trace", t.loss_trace, "log")],
                        [(f"--{name}-load", getattr(d, f"{name}_load", None), name)
                         for name in ("teacher", *(r for r in build.roles if r != "teacher"))])
        # a save folder holding checkpoints is written only by a resume from it (or --overwrite-save)
        overwrite_notes = check_fresh_save([("--save", t.save), *((what, path) for what, path, _ in dirs)],
                                           [t.load, *(role_dir(t.load, n) for n in others)] if t.load else [],
                                           t.overwrite_save)
        # a method that regresses onto teacher paths reads --data as a trajectory set (`data/trajectories.py`)
        self.dataset = TrajectoryDataset(t.data) if getattr(build, "reads_trajectories", False) else \
            build_dataset(t.data, "train")
        self.info = data_info(self.dataset)
        self.media = (EvalMedia(t.data, self.dataset, t.eval_prompts, t.vae, ps.is_main, ps.device)
                      if t.eval_interval else None)  # --eval-prompts / --vae checked before any training
        teacher_payload = self._init_payload(d.teacher_load, "--teacher-load")
        if teacher_payload is None:
            raise CheckpointError(f"--teacher-load {d.teacher_load} holds no checkpoint "
                                  f"(no latest_checkpointed_iteration.txt)")
        check_role(teacher_payload, ("teacher", "student") if d.allow_student_teacher else ("teacher",),
                   "--teacher-load", d.teacher_load, "" if d.allow_student_teacher else
                   " (pass --allow-student-teacher to distill a distilled student)")
        self.family = get_size(cfg.model.size).family_name
        check_family(teacher_payload, self.family, "--teacher-load", d.teacher_load)
        saved_info = teacher_payload.get("data_info")  # None: converted from a public checkpoint (no data)
        if saved_info is not None and DataShape.from_info(saved_info) != DataShape.from_info(self.info):
            raise CheckpointError(f"--teacher-load {d.teacher_load} was trained on data {teacher_payload['data_info']} "
                                  f"but --data {t.data} is {self.info}")
        self.shape = DataShape.from_info(self.info).sample_shape
        self.method = method = build(cfg, self.shape, ps.device)
        if hasattr(method, "check_data"):  # e.g. trajectories stored at the method's grid
            method.check_data(self.dataset)
        self.trained_in = trained_in(method.phases)  # phase -> the role its optimizer step trains
        self.shared_base: list = []  # the LoRA roles over the teacher's weights (`_adapt`)
        self.lora_meta: dict = {}  # role -> its adapters and base, as its checkpoints record them (`_adapt`)
        # the teacher first: LoRA roles may share its weights
        teacher = self._build_model("teacher", teacher_payload) if "teacher" in build.roles else None
        models = {name: teacher if name == "teacher" else self._build_model(name, teacher_payload, teacher)
                  for name in build.roles}
        student = models["student"]
        self.ema = StudentEMA(student, cfg.ema.decay, cfg.ema.start_iter) if cfg.ema.enabled else None
        self.offload, offload_note = self._offload_plan()
        self.roles = {name: self._role(name, model, tuple(self.ema.tensors()) if self.ema and name == "student"
                                       else ()) for name, model in models.items()}
        set_prefetch(cfg.dmd2.offload_prefetch)
        if cfg.dmd2.offload_prefetch:
            offload_note += "; prefetch: the next phase's roles wake during the last step"
        self.graphs, graphs_note = cuda_graphs.choose(cfg.dmd2.cuda_graphs, ps.device, offload=self.offload,
                                                      tp=ps.tp_size, cp=ps.cp_size, sp=ps.sequence_parallel)
        if self.graphs:
            graphs_note += f", {cuda_graphs.install({name: r.model for name, r in self.roles.items()})}"
        nparams = count_parameters(student, ps.tp_group, ps.device)
        ema_note = f"student EMA {cfg.ema.decay} from cycle {cfg.ema.start_iter}" if self.ema else "EMA off"
        print_rank0(f"> {method.name}: {cfg.model.size} ({nparams:,} parameters per role, {len(self.roles)} roles); "
                    f"{ps.layout} megatron-jit={fuser_state()}; compile "
                    f"{cfg.model.compile_choice(ps.device, ps.tp_size, ps.cp_size, ps.sequence_parallel)[1]}; "
                    f"attention {cfg.model.attention_choice(ps.device, cfg.optim.bf16)[1]}; "
                    f"cuda graphs {graphs_note}; B={t.micro_batch_size} "
                    f"{method.describe(self.num_micro_batches, self.dataset.null_note)}; "
                    f"offload {'+'.join(sorted(self.offload)) or 'none'} "
                    f"({offload_note}); {method.describe_parts(self.roles)}; {ema_note}", ps.rank)
        per_sample = sample_flops(cfg.model.size, self.info, ps.tp_size, ps.cp_size, ps.rank)
        self.flops_per_iter = method.flops_per_iter(per_sample, self.num_micro_batches)
        self.clock = PhaseClock(ps.device)
        self.peak = memory_record.PeakResident()
        f, b = method.data_factor, t.micro_batch_size
        self.sampler = GlobalBatchSampler(len(self.dataset), t.global_batch_size * f, b * f,
                                          ps.dp_rank, ps.dp_size, t.seed)
        self.batches = MicroBatchLoader(self.dataset, self.sampler, ps.device, t.num_workers,
                                        latents=method.reads_samples)
        self.state = RunState(pair_token=uuid.uuid4().hex)
        self.generators: dict = {}  # (micro-batch index, stream) -> its generator, re-seeded per cycle
        self.static = {"args": asdict(cfg), "data_info": self.info, "family": self.family, "method": method.name,
                       "student_sigmas": method.student_sigmas.tolist()}
        if t.load:
            self.load(t.load)
        if t.save:  # every check passed: only now is anything created in --save (a failed start leaves nothing)
            check_writable(t.save)
            for name in others:
                check_writable(role_dir(t.save, name))
            lock_run_dirs([("--save", t.save), *((f"--save (its {name} directory)", role_dir(t.save, name))
                                                 for name in others)], ps)
            for note in overwrite_notes:
                print_rank0(note, ps.rank)
        self.exit = ExitController(t.exit_signal_handler, t.exit_duration_in_mins, ps.rank, ps.device, start)

    # ---- roles ---------------------------------------------------------------------------------
    def _build_model(self, name: str, teacher_payload: dict, teacher=None) -> torch.nn.Module:
        """The role's model with its init weights: --<name>-load, else the teacher's; the method may wrap it
        (DMD2's GAN head: the critic is a GANCritic). A LoRA role (--<name>-lora-rank) is adapters over those
        weights frozen: the `teacher` model's own when it starts from the teacher (`lora.adapt`)."""
        cfg, ps, d = self.cfg, self.ps, self.cfg.dmd2
        # a method may build a role otherwise (Self-Forcing: only the student is causal)
        model_cfg = self.method.model_config(name, cfg.model) if hasattr(self.method, "model_config") else cfg.model
        model = build_model(model_cfg, self.info, ps, negative=self.dataset.negative)
        own = getattr(d, f"{name}_load", None)
        source = own or d.teacher_load
        flag = f"--{name}-load {source}" if own else f"--teacher-load {source} (the {name}'s init)"
        payload = teacher_payload if source == d.teacher_load else self._init_payload(source, f"--{name}-load")
        if payload is None:
            raise CheckpointError(f"{flag} holds no checkpoint")
        if own and name != "teacher":  # an init of the student / critic: a teacher's, or one of its own role
            check_role(payload, ("teacher", name), f"--{name}-load", source)
            check_family(payload, self.family, f"--{name}-load", source)
        hint = model_size_hint(payload, cfg.model.size)
        shared = teacher if source == d.teacher_load and not cfg.lora.no_shared_base else None

        def load(module, state):
            load_model_weights(module, state, flag, hint)
            if cfg.lora.rank(name):
                self._adapt(name, module, shared, payload, source)
        return cast_model(self.method.init_model(name, model, payload["model"], load), cfg.optim.bf16)

    def _init_payload(self, source: str, flag: str) -> Optional[dict]:
        """The checkpoint in `source` as an init (--teacher-load, --<role>-load): full weights, a LoRA run's adapters
        merged into the base they name (`lora_checkpoint.merged_payload`, as launch/sample.py reads a LoRA student),
        which the start-up log says."""
        payload = load_payload(source, self.ps, flag=flag)
        if payload is None or payload.get("lora") is None:
            return payload
        merged = merged_payload(payload, self.ps, f"{flag} {source}")
        meta = merged["lora_merged"]
        print_rank0(f"> {flag} {source} holds LoRA adapters (rank {meta['rank']}, {payload.get('role', '?')}): "
                    f"merged into their base {meta['base']} as this run's init", self.ps.rank)
        return merged

    def _adapt(self, name: str, module: torch.nn.Module, shared, payload: dict, source: str) -> None:
        """Role `name` as LoRA adapters (--<name>-lora-rank) over `module`'s weights, or `shared`'s (module
        docstring of `models/lora.py`), the base being checkpoint `source` (`payload`: what its checkpoint records,
        `train/lora_checkpoint.py`); the start-up log says which linears and whose base."""
        lo, family = self.cfg.lora, get_size(self.cfg.model.size).family
        targets = lo.target_modules or family.lora_targets
        unknown = sorted(set(targets) - set(family.lora_targets))
        if not family.lora_targets or unknown:
            raise ConfigError(f"--lora-target-modules: {family.title} has no linear named {','.join(unknown)} "
                              f"(its LoRA targets: {','.join(family.lora_targets) or 'none'})")
        rank = lo.rank(name)
        linears = adapt(module, targets, rank, lo.alpha or rank, self.cfg.train.seed + zlib.crc32(name.encode()),
                        base=shared)
        base = "the teacher's weights, shared" if shared is not None else "its own frozen copy of its init"
        if shared is not None:
            self.shared_base.append(name)
        base_path = os.path.abspath(source)
        known = [m["fingerprint"] for m in self.lora_meta.values() if m["base"] == base_path]  # one pass per base
        fingerprint = known[0] if known else state_fingerprint(payload["model"], payload["partition_dims"], self.ps)
        self.lora_meta[name] = {"rank": rank, "alpha": lo.alpha or rank, "scale": (lo.alpha or rank) / rank,
                                "targets": list(targets), "base": base_path, "fingerprint": fingerprint}
        count = sum(rank * (lin.in_features + lin.out_features) for lin in linears)
        print_rank0(f"> {name}: LoRA rank {rank} alpha {lo.alpha or rank:g} on {len(linears)} linears "
                    f"({','.join(targets)}; {count:,} adapter parameters) over {base}", self.ps.rank)

    def _role(self, name: str, model: torch.nn.Module, extra: tuple = ()) -> Role:
        """Role `name` over `model`; one that sleeps between phases gets its parameters in a few flat buffers first
        (`flat.flatten_parameters`: a sleep and a wake then copy a few storages, not one per parameter)."""
        cfg, ps = self.cfg, self.ps
        if name in self.offload:
            flatten_parameters(model)
        if name not in self.trained_in.values():  # frozen: the teacher
            model.requires_grad_(False)
            model.eval()
            role = Role(name, model)
        else:
            optim_cfg = cfg.optim if name == "student" else cfg.critic_optim()
            grads, optimizer = build_grads_and_optimizer(model, optim_cfg, ps)
            save = (cfg.train.save and role_dir(cfg.train.save, name)) or None
            role = Role(name, model, optimizer,
                        LRSchedule(optim_cfg, cfg.train.train_iters), grads, save, extra, lora=self.lora_meta.get(name))
        return role.with_offload(ps.device, self.method.phases) if name in self.offload else role

    def _offload_plan(self) -> tuple[frozenset, str]:
        """(the roles that sleep in the phases that do not use them, why): the flags (--offload-roles,
        --offload-inactive, --no-offload-inactive: `DMD2Config.offload_set`), else on CUDA the method's memory
        plan's cheapest set that fits memory_plan.PLAN_HEADROOM x --gpu-memory-gb (default the device's), else
        none."""
        d, ps = self.cfg.dmd2, self.ps
        asked = d.offload_set(self.role_names)
        if self.shared_base:  # a Sleeper would move the teacher's weights from under the LoRA roles that use them
            if asked:
                raise ConfigError(f"--offload-roles / --offload-inactive: the LoRA roles {', '.join(self.shared_base)} "
                                  f"share the teacher's weights, which stay resident; time-slicing a shared base is "
                                  f"not supported yet: give --no-offload-inactive, or --no-lora-shared-base")
            return frozenset(), f"the LoRA roles {', '.join(self.shared_base)} share the teacher's resident weights"
        if asked is not None:
            flag = (f"--offload-roles {','.join(d.offload_roles)}" if d.offload_roles is not None else
                    "--offload-inactive" if d.offload_inactive else "--no-offload-inactive")
            return asked, flag
        if ps.device.type != "cuda":
            return frozenset(), "on a CPU there is no device memory to save"
        gib = d.gpu_memory_gb or torch.cuda.get_device_properties(ps.device).total_memory / 2**30
        roles, totals, fits = self.method.plan_offload(self.cfg, ps, self.info, PLAN_HEADROOM * gib * 2**30)
        note = f"memory plan: phase peak {max(totals.values()) / 2**30:.1f} GiB of {gib:g} GiB"
        return roles, note + ("" if fits else "; OVER the budget even with every role offloaded")

    # ---- checkpoints (methods/pair_checkpoint.py) ----------------------------------------------
    def save(self) -> None:
        self.state = save_pair(self.roles, replace(self.state, sampler=self.sampler.state_dict()), self.static,
                               self.ps, self.ema, self.trained)

    def load(self, root: str) -> None:
        self.state = load_pair(self.roles, root, self.state, self.cfg, self.ps, self.method, self.ema, self.trained)
        if self.state.sampler is not None:
            self.sampler.load_state_dict(self.state.sampler)

    # ---- one cycle -----------------------------------------------------------------------------
    def micro_batches(self) -> list[MicroBatch]:
        """This rank's micro-batch records of the next cycle (advances the sampler). Their generators are the run's
        own (`_generator`), re-seeded for this cycle: the records of an earlier cycle draw this cycle's numbers."""
        t, it = self.cfg.train, self.iteration
        n = self.method.data_factor * t.micro_batch_size
        out = []
        for j, images, cond in self.batches.next_iteration():
            out.append(MicroBatch(
                index=j, cond=cond, sample_id_offset=(it * self.num_micro_batches * self.ps.dp_size + j) * n,
                rollout_gen=self._generator(j, ROLLOUT), critic_gen=self._generator(j, CRITIC),
                actor_gen=self._generator(j, ACTOR),
                real=images,  # the dataset's samples of these conditions (None unless the method reads them)
                stop_gen=self._generator(j, STOPS)))
        return out

    def _generator(self, j: int, stream: int) -> torch.Generator:
        """Micro-batch j's generator of `stream` (STOPS on the host, the others on the compute device), made on first
        use and kept for the run, re-seeded with this cycle's keyed seed: bit-equal to a new one."""
        t = self.cfg.train
        key = (j, stream)
        if key not in self.generators:
            self.generators[key] = torch.Generator(device=torch.device("cpu") if stream == STOPS else self.ps.device)
        return micro_batch_generator(t.seed, self.iteration, j, None, stream=stream, generator=self.generators[key])

    def cycle(self) -> dict:
        """One cycle with this iteration's learning rates, then the EMA update. Returns device-tensor metrics,
        the lr per phase, resident bytes per phase and the optimizer steps each trained role skipped (device
        tensors)."""
        trained = {name: self.roles[name] for name in self.trained_in.values()}
        lrs = {phase: trained[name].schedule.apply(trained[name].optimizer, self.iteration)
               for phase, name in self.trained_in.items()}
        skipped = {name: r.optimizer.skip_counters[0] for name, r in trained.items()}  # device tensors: no sync
        with cuda_graphs.capturing() if self.graphs else contextlib.nullcontext():
            result = self.method.cycle(self.roles, self.micro_batches(), hook=self.clock)
        compiled.seal()  # the first cycle compiled the blocks' graphs: a later compilation is logged
        if self.graphs:
            cuda_graphs.seal()  # likewise the captured graphs: a later capture (a new rollout count) is logged
            cuda_graphs.report_new(self.ps.rank)
        self.clock.end_cycle()
        self.peak.update(result.resident)
        self.state = replace(self.state, iteration=self.iteration + 1)
        if self.ema is not None:
            self.ema.update(self.iteration)
        skipped = {name: r.optimizer.skip_counters[0] - skipped[name] for name, r in trained.items()}
        return {"metrics": result.metrics, "lr": lrs, "resident": result.resident, "skipped": skipped}

    # ---- evaluation ----------------------------------------------------------------------------
    def evaluate(self, out_dir: Optional[str]) -> Optional[dict]:
        t, ps = self.cfg.train, self.ps
        enter_phase(self.method.eval_phase, self.roles, self.method.phases)
        cond = (self.media.conditions(self.dataset, t.eval_num_samples) if self.media else
                eval_conditions(self.dataset, t.eval_num_samples))
        student = self.roles["student"].model
        use_ema = self.ema is not None and not self.cfg.ema.no_ema
        with self.ema.swapped_in(student) if use_ema else contextlib.nullcontext():
            images = generate_student(student, cond, self.method.student_sigmas, shape=self.shape, seed=t.seed + 7,
                                      device=ps.device, dp_rank=ps.dp_rank, dp_size=ps.dp_size, dp_group=ps.dp_group)
        if not ps.is_main:
            return None
        return {"weights": "EMA" if use_ema else "raw",
                **sample_results(images, cond, out_dir, "cycle", self.iteration, t.data, self.media)}

    # ---- the loop ------------------------------------------------------------------------------
    def train(self) -> dict:
        def step():
            out = self.cycle()
            optimizers = {name: self.roles[name].optimizer for name in out["skipped"]}
            return (self.iteration, out), optimizers, out["skipped"]

        result = train_loop(self, step, "cycle", self.method.name)
        self._report_memory()
        return result

    def _report_memory(self) -> None:
        """The run's measured peak resident bytes and process RSS (`train/memory_record.py`): logged, and with
        --save written to <save>/memory.json."""
        if self.peak.peak()[0] is None:  # no cycle ran (resumed at --train-iters)
            return
        trainable = sum(p.numel() for name in set(self.trained_in.values())
                        for p in self.roles[name].model.parameters() if p.requires_grad)
        summary = self.peak.summary(trainable, str(self.ps.device))
        print_rank0(f"> memory (rank 0): {memory_record.PeakResident.describe(summary)}", self.ps.rank)
        if self.cfg.train.save and self.ps.is_main:
            memory_record.write(self.cfg.train.save, summary)

    def log(self, logger: TrainLogger, pending: list) -> None:
        phases = self.trained_in
        keys = list(pending[0][1]["metrics"])
        # the skip counts are equal on every DP rank, so the DP mean leaves them as they are
        stats = torch.stack([torch.stack([o["metrics"][k_].float() for k_ in keys]
                                         + [o["skipped"][name].float() for name in phases.values()])
                             for _, o in pending])
        stats = all_reduce_mean(stats.contiguous(), self.ps.dp_group)
        vals = stats.cpu().tolist()  # the one host sync per log interval
        per_iter = [dict(iteration=it, **dict(zip(keys, v))) for (it, _), v in zip(pending, vals)]
        last = pending[-1][1]
        metrics = {f"{phase}-lr": last["lr"][phase] for phase in phases}
        metrics.update({k_: sum(v[i] for v in vals) / len(vals) for i, k_ in enumerate(keys)})
        metrics.update({f"resident-MB-{p}": r / 2**20 for p, r in last["resident"].items()})
        metrics.update({f"{phase} nan iterations": int(round(sum(v[len(keys) + i] for v in vals)))
                        for i, phase in enumerate(phases)})
        metrics.update({f"{phase}-ms": 1000 * sec for phase, sec in self.clock.take().items()})
        metrics["_samples_per_iter"] = self.cfg.train.global_batch_size
        metrics["_flops_per_iter"] = self.flops_per_iter
        logger.log(self.iteration, self.sampler.consumed_samples, metrics, per_iter)
