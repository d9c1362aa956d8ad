"""The quality metric of the embedded data sets, chosen by the `--data` name (the trainers' periodic eval).

    metrics_for_data("digits", images [N, 1, 8, 8], labels int64 [N])           -> eval.digits.evaluate_digits
    metrics_for_data("moving-digits", clips [N, 1, T, H, W], prompts [N, L, D])  -> eval.moving_digits, with the
                        (digit, direction) decoded from the prompt embeddings and T = 4 ("moving-digits:T": T)
                        checked; conditions that are no moving-digits prompts (--eval-prompts) cannot be scored:
                        {"metric": "skipped: <why>"}
    any other --data (a shard directory: no held-out split)                      -> {}
"""
from __future__ import annotations

import torch

from dmd2_mega.data.moving_digits import decode_conditions, frames_of_spec
from dmd2_mega.errors import DataError
from dmd2_mega.eval.digits import evaluate_digits
from dmd2_mega.eval.moving_digits import evaluate_moving_digits


def metrics_for_data(data: str, images: torch.Tensor, cond: torch.Tensor) -> dict:
    """The metric dict of samples `images` generated for conditions `cond` of `--data data` ({} if it has none)."""
    if data == "digits":
        return evaluate_digits(images, cond)
    frames = frames_of_spec(data)
    if frames is not None:
        try:
            digits, directions = decode_conditions(cond)
        except DataError as e:
            return {"metric": f"skipped: {e}"}
        return evaluate_moving_digits(images, digits, directions, frames=frames)
    return {}
