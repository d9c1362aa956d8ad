"""dmd2-mega: DMD2 distillation of flow-matching diffusion transformers on megatron-core.

Layers, bottom up (`.importlinter` at the repo root enforces them: a layer imports only the layers below it; the
one-page picture with where new code goes is docs/architecture.md):
  errors, megatron_import   every error type; megatron-core's import made quiet and cheap (before it loads)
  distributed/, flow, files/ torchrun and TP / CP / DP groups, megatron-core on a CPU torch; flow-matching maths
                            and every sigma grid; all-or-nothing writes, staged outputs, directory locks, path guards
  models/                   the family contract, the registry of `--model-size`s, the DiT and Wan families
  config, data/             composed config dataclasses (validated once); datasets, shards and loaders
  train/, prep/, arguments  the shared training machinery (optimizers, checkpoints, offload, loop, ...);
                            data preparation; the Megatron-style flags onto the config
  sampling, plan/           teacher / student samplers; the memory planner and FLOP accounting
  eval/, pretrained         quality metrics and eval media; real checkpoints in and out
  teacher_trainer, methods/ flow-matching pretraining of the teacher (`launch/pretrain_flow.py`); the distillation
                            methods (DMD2 first) and the student trainer they share (`launch/pretrain_dmd2.py`)
The Triton kernels live in the `dmd2_kernels` package (the folder kernels/dmd2_kernels/), which imports nothing from
here.
"""
__version__ = "0.1.0"

from dmd2_mega import megatron_import  # noqa: E402  (before any module here imports megatron-core)

megatron_import.install()
