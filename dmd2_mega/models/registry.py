"""Named model sizes (`--model-size`), nanoGPT/DiT style: each name maps to (family, spec).

DiT sizes: per block the DiT holds ~18 H^2 weights (attention 4 H^2, MLP 8 H^2 at ratio 4, adaLN
6 H^2); the real sizes are chosen so the whole model lands near its name at patch 2 on 4x32x32
latents. The exact count of the built model is printed at start-up (`family.count_parameters`).
Wan sizes are the public diffusers configs (wan-debug is a tiny one for tests); `--model-size` also takes a
path to a diffusers folder (or a checkpoint converted from one), whose config.json defines the spec.
wan-digits is the teacher of the embedded `--data moving-digits` clips [1, 4, 16, 16] with prompt embeddings
[4, 16] (launch/quickstart_video.sh): 1 grey channel, text_dim 16, 4 heads x 16, 4 layers, ffn 256, patch
(1, 4, 4) (64 tokens per clip), 0.3 M parameters. Measured on 2 CPU cores, batch 64: wan-debug's sizes at patch
(1, 2, 2) (256 tokens) took 0.24-0.8 s per step and after 1,500 steps still drew noise (10% digit accuracy);
hidden 64 at patch (1, 2, 2) cost 2-8x more per step; at patch (1, 4, 4) hidden 64 x 4 layers costs 0.25 s
per step and reaches 88% digit accuracy in 1,800 steps.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from dmd2_mega.errors import ConfigError
from dmd2_mega.models.dit import DIT, DiTSpec
from dmd2_mega.models.diffusers_folder import read_json
from dmd2_mega.models.dit_checkpoints import diffusers_spec, is_diffusers_config, is_our_config, spec_from_ours
from dmd2_mega.models.family import BuildOptions, DataShape, FamilyModel, ModelFamily
from dmd2_mega.models.wan import WAN, WanSpec
from dmd2_mega.models.wan_experts import EXPERTS, WAN_EXPERTS


@dataclass(frozen=True)
class ModelSize:
    family: ModelFamily
    spec: object


def _dit(name: str, **kw) -> tuple[str, ModelSize]:
    return name, ModelSize(DIT, DiTSpec(name=name, **kw))


def _wan(name: str, **kw) -> tuple[str, ModelSize]:
    spec = WanSpec(name=name, **kw)
    return name, ModelSize(WAN_EXPERTS if spec.boundary_ratio is not None else WAN, spec)


MODEL_SIZES: dict[str, ModelSize] = dict([
    _dit("debug", hidden_size=32, num_layers=2, num_heads=4, patch_size=2, freq_dim=32),
    _dit("digits", hidden_size=128, num_layers=4, num_heads=4, patch_size=2, freq_dim=128),
    _dit("600m", hidden_size=1152, num_layers=24, num_heads=16, patch_size=2),
    _dit("2b", hidden_size=2048, num_layers=26, num_heads=16, patch_size=2),
    _dit("8b", hidden_size=4096, num_layers=26, num_heads=32, patch_size=2),
    # Wan: the sizes of the public diffusers configs (a folder's own config.json is used when given by path)
    _wan("wan-debug", num_heads=2, head_dim=12, num_layers=2, ffn_dim=48, in_channels=4, out_channels=4,
         text_dim=16, freq_dim=16),
    _wan("wan-digits", num_heads=4, head_dim=16, num_layers=4, ffn_dim=256, in_channels=1, out_channels=1,
         text_dim=16, freq_dim=32, patch_size=(1, 4, 4)),
    _wan("wan2.1-1.3b", num_heads=12, head_dim=128, num_layers=30, ffn_dim=8960),
    _wan("wan2.1-14b", num_heads=40, head_dim=128, num_layers=40, ffn_dim=13824),
    _wan("wan2.2-ti2v-5b", num_heads=24, head_dim=128, num_layers=30, ffn_dim=14336, in_channels=48,
         out_channels=48),
    _wan("wan2.2-a14b", num_heads=40, head_dim=128, num_layers=40, ffn_dim=13824, boundary_ratio=0.875),
])


def _config_path(name: str):
    """(config.json, the folder that may say it is two experts) of `--model-size <path>`: the file itself, a model
    folder or one of our converted checkpoints (the folder itself), or a pipeline folder (its transformer/
    config, the pipeline folder); None if `name` is no path."""
    if not (os.sep in name or os.path.exists(name)):
        return None
    if name.endswith((".pt", ".pth")):
        raise ConfigError(f"--model-size {name}: an official SiT / DiT .pt is converted first: "
                          f"launch/convert_checkpoint.py --from-official {name} --parameterization sit|vp-eps --save DIR")
    if os.path.isfile(name):
        return name, os.path.dirname(name)
    for cand in (os.path.join(name, "config.json"), os.path.join(name, EXPERTS[0], "config.json")):
        if os.path.isfile(cand):
            return cand, name
    raise ConfigError(f"--model-size {name}: no config.json in that folder (nor in its {EXPERTS[0]}/)")


def get_size(name: str) -> ModelSize:
    """A registered name, or a path to a diffusers config.json (or a folder holding one)."""
    if name in MODEL_SIZES:
        return MODEL_SIZES[name]
    found = _config_path(name)
    if found is None:
        raise ConfigError(f"--model-size {name!r} is unknown; choose one of {sorted(MODEL_SIZES)} or give a "
                          f"diffusers model folder with a config.json")
    path, folder = found
    dit = _dit_size(name, path, folder)
    if dit is not None:
        return dit
    ratio = boundary_ratio(folder)  # a model folder inside a pipeline (pipeline/transformer) is one model
    spec = WanSpec.from_file(path, ratio)
    return ModelSize(WAN_EXPERTS if ratio is not None else WAN, spec)


def _dit_size(name: str, path: str, folder: str):
    """The DiT family's size of a diffusers DiTTransformer2DModel folder (its pipeline's scheduler config fixes the
    VP schedule) or of one of our converted DiT checkpoints; None for any other config.json."""
    if not path.endswith(".json"):
        return None
    config = read_json(path)
    if is_our_config(config):
        return ModelSize(DIT, spec_from_ours(config, name))
    if not is_diffusers_config(config):
        return None
    here = os.path.dirname(os.path.abspath(path))
    sched = next((p for p in (os.path.join(folder, "scheduler", SCHEDULER),
                              os.path.join(os.path.dirname(here), "scheduler", SCHEDULER)) if os.path.isfile(p)), None)
    return ModelSize(DIT, diffusers_spec(config, name, read_json(sched) if sched else None))


SCHEDULER = "scheduler_config.json"
EXPERTS_FILE = "wan_experts.json"
"""Written beside config.json in a checkpoint converted from a two-expert pipeline: {"boundary_ratio": r}."""


def boundary_ratio(folder: str):
    """The expert boundary of a two-expert Wan folder: a pipeline folder whose model_index.json sets boundary_ratio
    and which holds transformer_2/, or one of our checkpoints converted from one (EXPERTS_FILE); else None."""
    ours = os.path.join(folder, EXPERTS_FILE)
    index = os.path.join(folder, "model_index.json")
    for path, need in ((ours, None), (index, os.path.join(folder, EXPERTS[1], "config.json"))):
        if os.path.isfile(path) and (need is None or os.path.isfile(need)):
            try:
                with open(path) as f:
                    ratio = json.load(f).get("boundary_ratio")
            except (OSError, json.JSONDecodeError, AttributeError) as e:
                raise ConfigError(f"{path}: cannot read ({e})") from None
            if ratio is not None:
                return float(ratio)
    return None


def get_spec(name: str):
    return get_size(name).spec


def build_model(name: str, shape: DataShape, tp_size: int = 1, options: BuildOptions = BuildOptions()) -> FamilyModel:
    """The `--model-size` model for `shape` at TP degree `tp_size`, on the CPU, from the default RNG
    (identical on every rank, so the TP shards of a TP=2 model slice the TP=1 weights)."""
    size = get_size(name)
    return size.family.build(size.spec, shape, tp_size, options)
