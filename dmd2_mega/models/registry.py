"""Named DiT sizes (`--model-size`), nanoGPT/DiT style.

Per block the DiT holds ~18 H^2 weights (attention 4 H^2, MLP 8 H^2 at ratio 4, adaLN 6 H^2);
the real sizes are chosen so the whole model lands near its name at patch 2 on 4x32x32 latents.
The exact count of the built model is printed at start-up (`count_parameters`).
"""
from __future__ import annotations

from dataclasses import dataclass

from dmd2_mega.config import ConfigError


@dataclass(frozen=True)
class DiTSpec:
    hidden_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    mlp_ratio: float = 4.0
    freq_dim: int = 256
    """Width of the sinusoidal timestep features fed to the timestep MLP."""


MODEL_SIZES: dict[str, DiTSpec] = {
    "debug": DiTSpec(hidden_size=32, num_layers=2, num_heads=4, patch_size=2, freq_dim=32),
    "digits": DiTSpec(hidden_size=128, num_layers=4, num_heads=4, patch_size=2, freq_dim=128),
    "600m": DiTSpec(hidden_size=1152, num_layers=24, num_heads=16, patch_size=2),
    "2b": DiTSpec(hidden_size=2048, num_layers=26, num_heads=16, patch_size=2),
    "8b": DiTSpec(hidden_size=4096, num_layers=26, num_heads=32, patch_size=2),
}


def get_spec(name: str) -> DiTSpec:
    if name not in MODEL_SIZES:
        raise ConfigError(f"--model-size {name!r} is unknown; choose one of {sorted(MODEL_SIZES)}")
    return MODEL_SIZES[name]
