"""dmd2-mega: DMD2 distillation of flow-matching diffusion transformers on megatron-core.

Layout: `config` (dataclasses) + `arguments` (Megatron-style flags), `parallel` (torchrun,
TP/DP groups, RNG), `megatron_compat` (megatron-core on a CPU-only torch), `flow` (flow-matching
maths), `models/` (the DiT), `data/`, `optim`, `checkpoint`, `training`, `eval/`.
"""
__version__ = "0.1.0"
