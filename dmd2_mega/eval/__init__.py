"""Evaluation of generated samples.

`classifier` (a small CNN trained once on the 8x8 digits and cached), `frechet` (Frechet
distance between Gaussians fitted to feature sets), `digits` (`evaluate_digits` and the
`python -m dmd2_mega.eval.digits samples.npz` CLI), `grid` (PNG sample grids, one row per class).
Submodules are not imported here so that `python -m dmd2_mega.eval.digits` runs cleanly.
"""
