"""Distillation methods over shared roles (DESIGN section 10), and the machinery they share.

Shared: `base` (the `Method` protocol, the phase table (`Phase`), the micro-batch record, `CycleResult`),
`roles` (`Role`, `enter_phase(phase, roles, table)`: time-slicing through `dmd2_mega.train.offload`), `rollout`
(the student's backward simulation), `ema` (`StudentEMA`), `pair_checkpoint` (the trained roles saved and
resumed as one pair) and `trainer` (`StudentTrainer(cfg, method)`: roles, builders, micro-batches, the loop, the
eval). The methods: `dmd2/` (DMD2 with its optional GAN head; `methods.dmd2.method.DMD2Trainer`). A new method is
a sub-package with its phase table, settings and cycle (a `base.Method`), run by `StudentTrainer`; the shared
modules import no method (`.importlinter`).
"""
