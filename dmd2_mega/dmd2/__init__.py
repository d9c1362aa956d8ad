"""DMD2 distillation (DESIGN section 2).

`cycle` (`run_cycle`: one cycle, written once) over `rollout` (the student's backward simulation),
`critic` (K critic steps, `teacher_scores`), `actor` (the student's DMD step); `records` (the plain
data a cycle passes: `MicroBatch`, `CycleSettings`, `Scores`), `roles` (`Role`, the phase table,
`enter_phase`: time-slicing through `dmd2_mega.train.offload`), `gan` (`GANCritic`: the critic's trunk and
GAN head), `ema` (`StudentEMA`), `pair_checkpoint` (student + critic saved and resumed as one pair) and
`student_trainer` (`DMD2Trainer`, behind `launch/pretrain_dmd2.py`).
"""
