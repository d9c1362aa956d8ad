"""Named model sizes (`--model-size`), nanoGPT/DiT style: each name maps to (family, spec).

DiT sizes: per block the DiT holds ~18 H^2 weights (attention 4 H^2, MLP 8 H^2 at ratio 4, adaLN
6 H^2); the real sizes are chosen so the whole model lands near its name at patch 2 on 4x32x32
latents. The exact count of the built model is printed at start-up (`family.count_parameters`).
A second family registers its sizes here the same way; nothing else changes.
"""
from __future__ import annotations

from dataclasses import dataclass

from dmd2_mega.errors import ConfigError
from dmd2_mega.models.dit import DIT, DiTSpec
from dmd2_mega.models.family import BuildOptions, DataShape, FamilyModel, ModelFamily


@dataclass(frozen=True)
class ModelSize:
    family: ModelFamily
    spec: object


def _dit(name: str, **kw) -> tuple[str, ModelSize]:
    return name, ModelSize(DIT, DiTSpec(name=name, **kw))


MODEL_SIZES: dict[str, ModelSize] = dict([
    _dit("debug", hidden_size=32, num_layers=2, num_heads=4, patch_size=2, freq_dim=32),
    _dit("digits", hidden_size=128, num_layers=4, num_heads=4, patch_size=2, freq_dim=128),
    _dit("600m", hidden_size=1152, num_layers=24, num_heads=16, patch_size=2),
    _dit("2b", hidden_size=2048, num_layers=26, num_heads=16, patch_size=2),
    _dit("8b", hidden_size=4096, num_layers=26, num_heads=32, patch_size=2),
])


def get_size(name: str) -> ModelSize:
    if name not in MODEL_SIZES:
        raise ConfigError(f"--model-size {name!r} is unknown; choose one of {sorted(MODEL_SIZES)}")
    return MODEL_SIZES[name]


def get_spec(name: str):
    return get_size(name).spec


def build_model(name: str, shape: DataShape, tp_size: int = 1, options: BuildOptions = BuildOptions()) -> FamilyModel:
    """The `--model-size` model for `shape` at TP degree `tp_size`, on the CPU, from the default RNG
    (identical on every rank, so the TP shards of a TP=2 model slice the TP=1 weights)."""
    size = get_size(name)
    return size.family.build(size.spec, shape, tp_size, options)
