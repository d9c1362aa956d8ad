"""DMD2 distillation (DESIGN section 2), the first method of `methods/`.

`phases` (`PHASES`: DMD2's phase table), `records` (`DMD2Settings`, the method's settings; `Scores`), `cycle`
(`run_cycle`: one cycle, written once) over the shared rollout (`methods.rollout`), `critic` (K critic steps,
`teacher_scores`), `actor` (the student's DMD step); `gan` (the GAN head, the method's optional part:
`GANCritic`, the critic's trunk and head, and `GANSettings`, everything the head adds to the phases) and
`method` (`DMD2Method`, the `methods.base.Method` the shared trainer runs, and `DMD2Trainer`, behind
`launch/pretrain_dmd2.py`).
"""
