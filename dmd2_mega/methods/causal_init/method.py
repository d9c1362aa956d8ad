"""The causal student's initialisation from teacher trajectories (Self-Forcing / CausVid's ODE init), a method of the
shared student trainer (`methods.base.Method`, `methods.trainer.StudentTrainer`; `launch/pretrain_causal_init.py`).

Data: a trajectory set (`data/trajectories.py`, written by launch/prepare_trajectories.py): per sample the teacher's
Euler path x_{s_0}, ..., x_{s_{N-1}} at the N student sigmas and its x0. One phase, "regress" (the student alone,
trained): per micro-batch and per chunk c of the causal layout an index k_c ~ U{0..N} from the ACTOR stream,

    x   = the path's state at s_{k_c} on the frames of chunk c          (each chunk at its own level)
          k_c = N: the context level s_N = --causal-context-noise, x = (1 - s_N) x0 + s_N eps (0: the clean x0)
    x0^ = x - s_{k_c} v_student(x, s [B, chunks], cond)                 (frame by frame)
    loss = mean((x0^ - x0_teacher)^2)

so the block-causal student learns to map any mix of levels along the teacher's paths to the teacher's x0,
including chunks that follow chunks at the context level: what streaming generation feeds it (a finished chunk is
written to the KV cache at --causal-context-noise). The student starts from the teacher's weights
(--teacher-load); no teacher, critic or rollout runs during training.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from dmd2_mega import flow
from dmd2_mega.errors import ConfigError
from dmd2_mega.methods.base import CycleResult, MicroBatch, Phase, PhaseStep, table_roles, trained_in
from dmd2_mega.methods.roles import run_steps
from dmd2_mega.train.checkpoint_guard import RESUME_SETTINGS
from dmd2_mega.train.accumulate import MicroMean, per_micro
from dmd2_mega.train.optim import step_optimizer

PHASES = (Phase("regress", {"student": "all"}, trains="student"),)


def path_states(paths: torch.Tensor, k: torch.Tensor, of_frame: torch.Tensor) -> torch.Tensor:
    """paths [B, N + 1, C, F, H, W], grid indices k [B, chunks], the chunk of each frame of_frame [F]
    (`CausalLayout.frame_chunks`) -> x [B, C, F, H, W]: each chunk's frames at its own path state (one gather, no
    loop over samples or frames)."""
    b, _, c, f, h, w = paths.shape
    index = k[:, of_frame]  # [B, F]
    return paths.gather(1, index[:, None, None, :, None, None].expand(b, 1, c, f, h, w)).squeeze(1)


class CausalInitMethod:
    """Regression of the causal student onto the teacher's x0 along its paths (module docstring)."""

    name = "causal-init"
    roles = table_roles(PHASES)                   # student
    trained = tuple(trained_in(PHASES).values())  # student
    eval_phase = "regress"
    data_factor = 1
    reads_samples = True
    reads_trajectories = True  # the trainer reads --data as a trajectory set (`data.trajectories.TrajectoryDataset`)
    resume_settings = RESUME_SETTINGS
    # the shared DMD2 parser's flags this method never reads (launch/pretrain_causal_init.py refuses them): no critic,
    # no teacher score, no GAN head, no other method's settings
    unread = {"dmd2": ("distill_method", "self_forcing_exit", "self_forcing_rollout_frames", "causal_grad_chunks",
                       "critic_load", "critic_steps_per_rollout", "score_sigma_range", "critic_scoring",
                       "critic_loss_space", "teacher_guidance_scale", "critic_grid_size", "critic_lr", "critic_min_lr",
                       "critic_weight_decay", "critic_adam_beta1", "critic_adam_beta2"),
              "gan": "all", "lora": ("critic_rank",)}

    def __init__(self, cfg, shape: tuple, device: torch.device):
        d, t = cfg.dmd2, cfg.train
        self.cfg, self.device, self.phases = cfg, device, PHASES
        self.layout = cfg.model.causal_layout()
        if self.layout is None:
            raise ConfigError("launch/pretrain_causal_init.py trains a causal student: give --causal (and "
                              "--causal-chunk-frames)")
        if len(shape) != 4:
            raise ConfigError(f"a causal student takes video latents [C, T, H, W]; --data {t.data} holds "
                              f"{list(shape)}")
        self.chunks = self.layout.chunks(shape[1])
        self.of_frame = torch.tensor(self.layout.frame_chunks(shape[1]), device=device)
        self.student_sigmas = flow.student_sigmas(d.denoising_steps, d.student_sigmas, t.timestep_shift).to(device)
        self.context_noise = cfg.model.causal_context_noise
        self.levels = torch.cat([self.student_sigmas, self.student_sigmas.new_tensor([self.context_noise])])

    def loss(self, student, paths: torch.Tensor, cond: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """The regression loss of one micro-batch of paths [B, N + 1, *shape] (module docstring)."""
        n, b, c = len(self.student_sigmas), paths.shape[0], self.context_noise
        k = torch.randint(n + 1, (b, len(self.chunks)), generator=gen, device=paths.device)
        if c > 0:  # the context level is not on the path: x0 re-noised, as the cache re-run does
            eps = torch.randn(paths[:, -1].shape, generator=gen, device=paths.device, dtype=paths.dtype)
            paths = torch.cat([paths[:, :-1], ((1 - c) * paths[:, -1] + c * eps)[:, None], paths[:, -1:]], 1)
        x = path_states(paths, k, self.of_frame)
        sigma = self.levels[k]  # [B, chunks]
        v = student.model(x, sigma, cond).to(x.dtype)
        x0 = x - sigma[:, self.of_frame][:, None, :, None, None] * v
        return (x0.float() - paths[:, -1].float()).square().mean()

    def steps(self) -> tuple:
        return (PhaseStep("regress", self.regress_step),)

    def regress_step(self, roles: dict, batches: list[MicroBatch], given=None) -> tuple[None, dict]:
        """One student step: the regression loss of every micro-batch (draws from its actor generator)."""
        student, m = roles["student"], len(batches)
        total = MicroMean(m)
        for j, mb in enumerate(batches):
            with student.accumulating(last=j == m - 1):
                loss = self.loss(student, mb.real, mb.cond, mb.actor_gen)
                per_micro(loss, m).backward()
            total.add(loss.detach())
        norm = step_optimizer(student.optimizer, total.value)
        student.optimizer.zero_grad()
        return None, {"init-loss": total.value, "init-grad_norm": norm.to(total.value.device)}

    def cycle(self, roles: dict, batches: list[MicroBatch],
              hook: Optional[Callable[[str], None]] = None) -> CycleResult:
        _, metrics, resident = run_steps(self.steps(), roles, batches, self.phases, hook)
        return CycleResult(metrics, resident)

    def check_data(self, dataset) -> None:
        """ConfigError unless the trajectories were stored at this run's student grid."""
        got, want = dataset.sigmas, self.student_sigmas.tolist()
        if len(got) != len(want) or max(abs(a - b) for a, b in zip(got, want)) > 1e-6:
            raise ConfigError(f"--data {dataset.path} holds paths at the student sigmas {[round(s, 4) for s in got]}, "
                              f"but this run's grid (--dmd2-denoising-steps / --dmd2-student-sigmas, "
                              f"--timestep-shift) is {[round(s, 4) for s in want]}")

    def init_model(self, name: str, model: torch.nn.Module, state: dict, load: Callable) -> torch.nn.Module:
        load(model, state)  # the teacher's weights: the causal student has the same parameters
        return model

    def load_hint(self, name: str, state: dict) -> str:
        return ""

    def describe(self, num_micro_batches: int, null_note: str) -> str:
        return (f"M={num_micro_batches}; student sigmas {[round(s, 4) for s in self.student_sigmas.tolist()]}, "
                f"and the context level {self.context_noise:g}")

    def describe_parts(self, roles: dict) -> str:
        return f"{self.layout.describe()}; {len(self.chunks)} chunks of {[e - s for s, e in self.chunks]} frames"

    def plan_offload(self, cfg, ps, info: dict, budget: float) -> tuple[frozenset, dict, bool]:
        return frozenset(), {"regress": 0}, True  # one role: nothing to time-slice

    def flops_per_iter(self, per_sample, num_micro_batches: int) -> Optional[float]:
        """A training step per sample: one forward and its backward (3 forwards)."""
        return 3.0 * per_sample * self.cfg.train.micro_batch_size * num_micro_batches if per_sample else None
