"""dmd2-mega: DMD2 distillation of flow-matching diffusion transformers on megatron-core.

Layers, bottom up (`.importlinter` at the repo root enforces them; no module imports one above it):
  megatron_import   before megatron-core loads: its torch.compile fuser off (start-up time), its four
                    "Transformer Engine and Apex are not installed" warnings filtered
  errors            every error type (`ConfigError`, `DataError`, `CheckpointError`, ...)
  atomic            the one all-or-nothing file write
  megatron_compat   megatron-core on a CPU-only torch (RNG tracker, TP gather)
  parallel          torchrun, TP/DP groups, RNG streams per micro-batch, `tp_partition_dim`
  flow              flow-matching maths and every sigma grid (sampler, student, critic)
  models/           the model-family interface, the registry of `--model-size`s, the DiT family
  config, arguments composed config dataclasses (validated once) and the Megatron-style flags onto them
  data/, optim, offload, logger, resilience, checkpoint (+ `RunState`), memory_plan, sampling, eval/
  builders          model / data-info builders the trainers share
  loop              the training loop both trainers run (`Trainer` protocol)
  teacher_trainer   flow-matching pretraining of the teacher (`launch/pretrain_flow.py`)
  dmd2/             one DMD2 cycle and the student trainer (`launch/pretrain_dmd2.py`)
The Triton kernels live in the top-level `kernels` package, which imports nothing from here.
"""
__version__ = "0.1.0"

from dmd2_mega import megatron_import  # noqa: E402  (before any module here imports megatron-core)

megatron_import.install()
