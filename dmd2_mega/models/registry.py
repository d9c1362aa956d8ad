"""The families (`FAMILIES`) and the named model sizes (`--model-size`), nanoGPT/DiT style: each name maps to
(family, spec); a path is recognised by the family whose `recognise` reads its config.json (`get_size`), a source to
import by the family whose `reads_source` takes it (`source_family`), and a spec's family by its type (`family_of`).
A path no family recognises is one ConfigError naming the path and the families tried, never a default family.

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
wan-digits-i2v is wan-digits in the concat image-to-video form (`models/wan/image.py`) for `--data
moving-digits-i2v`: in_channels 2 x 1 + 4 = 6 (the clip, the 4-channel first-frame mask, the given first frame
followed by zero frames), out_channels 1, no CLIP embedding (image_dim None).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from dmd2_mega.errors import ConfigError
from dmd2_mega.files.json_file import read_json
from dmd2_mega.models import compiled
from dmd2_mega.models.diffusers_folder import TRANSFORMER
from dmd2_mega.models.dit import DIT, DiTSpec
from dmd2_mega.models.family import BuildOptions, DataShape, FamilyModel, ModelFamily
from dmd2_mega.models.wan import WAN, WanSpec

FAMILIES: tuple[ModelFamily, ...] = (DIT, WAN)
"""Every family, in the order they are asked to recognise a path."""


@dataclass(frozen=True)
class ModelSize:
    family: ModelFamily
    spec: object

    @property
    def family_name(self) -> str:
        """The family's tag that checkpoints record (payload "family"), compared for identity only."""
        return self.family.name


def _dit(name: str, **kw) -> tuple[str, ModelSize]:
    return name, ModelSize(DIT, DiTSpec(name=name, **kw))


def _wan(name: str, **kw) -> tuple[str, ModelSize]:
    return name, ModelSize(WAN, WanSpec(name=name, **kw))


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
    _wan("wan-digits-i2v", num_heads=4, head_dim=16, num_layers=4, ffn_dim=256, in_channels=6, out_channels=1,
         text_dim=16, freq_dim=32, patch_size=(1, 4, 4)),
    _wan("wan2.1-1.3b", num_heads=12, head_dim=128, num_layers=30, ffn_dim=8960),
    _wan("wan2.1-14b", num_heads=40, head_dim=128, num_layers=40, ffn_dim=13824),
    _wan("wan2.2-ti2v-5b", num_heads=24, head_dim=128, num_layers=30, ffn_dim=14336, in_channels=48,
         out_channels=48),
    _wan("wan2.2-a14b", num_heads=40, head_dim=128, num_layers=40, ffn_dim=13824, boundary_ratio=0.875),
    # image-to-video (`models/wan/image.py`): Wan 2.1 I2V 14B (480P and 720P share the transformer), Wan 2.2 I2V A14B
    _wan("wan-i2v-debug", num_heads=2, head_dim=12, num_layers=2, ffn_dim=48, in_channels=12, out_channels=4,
         text_dim=16, freq_dim=16, image_dim=8),
    _wan("wan2.1-i2v-14b-480p", num_heads=40, head_dim=128, num_layers=40, ffn_dim=13824, in_channels=36,
         image_dim=1280),
    _wan("wan2.1-i2v-14b-720p", num_heads=40, head_dim=128, num_layers=40, ffn_dim=13824, in_channels=36,
         image_dim=1280),
    _wan("wan2.2-i2v-a14b", num_heads=40, head_dim=128, num_layers=40, ffn_dim=13824, in_channels=36,
         boundary_ratio=0.9),
])


def family_of(spec) -> ModelFamily:
    """The family whose spec `spec` is."""
    for family in FAMILIES:
        if isinstance(spec, family.spec_type):
            return family
    raise ConfigError(f"{type(spec).__name__} is the spec of no model family ({', '.join(f.name for f in FAMILIES)})")


def tried() -> str:
    """The families and what each recognises, for the error of a path none reads."""
    return "; ".join(f.reads for f in FAMILIES)


def _config_path(name: str):
    """(config.json, the folder that may say more) of `--model-size <path>`: the file itself, a model folder or one
    of our converted checkpoints (the folder itself), or a pipeline folder (its transformer/ config, the pipeline
    folder); None if `name` is no path."""
    if not (os.sep in name or os.path.exists(name)):
        return None
    if name.endswith((".pt", ".pth")):
        raise ConfigError(f"--model-size {name}: an official SiT / DiT .pt is converted first: "
                          f"launch/convert_checkpoint.py --from-official {name} --parameterization sit|vp-eps --save DIR")
    if os.path.isfile(name):
        return name, os.path.dirname(name)
    for cand in (os.path.join(name, "config.json"), os.path.join(name, TRANSFORMER, "config.json")):
        if os.path.isfile(cand):
            return cand, name
    raise ConfigError(f"--model-size {name}: no config.json in that folder (nor in its {TRANSFORMER}/)")


def _class_of(path: str) -> str:
    """What a config file says it is, for an error."""
    try:
        cls = read_json(path).get("_class_name")
    except ConfigError:
        return "not a JSON object"
    return f"_class_name {cls!r}" if cls else "no _class_name"


def get_size(name: str) -> ModelSize:
    """A registered name, or a path to a config.json (or a folder holding one) that a family recognises."""
    if name in MODEL_SIZES:
        return MODEL_SIZES[name]
    found = _config_path(name)
    if found is None:
        raise ConfigError(f"--model-size {name!r} is unknown; choose one of {sorted(MODEL_SIZES)} or give a "
                          f"diffusers model folder with a config.json")
    path, folder = found
    for family in FAMILIES:
        spec = family.recognise(path, folder, name)
        if spec is not None:
            return ModelSize(family, spec)
    raise ConfigError(f"--model-size {name}: no model family recognises {path} ({_class_of(path)}); tried {tried()}")


def source_family(src: str, subfolder: Optional[str] = None, flag: str = "--from-diffusers") -> ModelFamily:
    """The family that reads `src` (a public folder, a pipeline folder, an official file) to import it."""
    for family in FAMILIES:
        if family.reads_source(src, subfolder):
            return family
    if not os.path.isdir(src):
        raise ConfigError(f"{flag} {src}: not a directory, nor a checkpoint file a family reads; tried {tried()}")
    where = [os.path.join(d, "config.json") for d in (src, os.path.join(src, subfolder or TRANSFORMER))]
    cfg = next((p for p in where if os.path.isfile(p)), None)
    if cfg is None:
        raise ConfigError(f"{flag} {src}: no config.json there nor in {subfolder or TRANSFORMER}/ (a diffusers model "
                          f"folder or a pipeline folder holding one); tried {tried()}")
    raise ConfigError(f"{flag} {src}: no model family reads {cfg} ({_class_of(cfg)}); tried {tried()}")


def get_spec(name: str):
    return get_size(name).spec


def build_model(name: str, shape: DataShape, tp_size: int = 1, options: BuildOptions = BuildOptions()) -> FamilyModel:
    """The `--model-size` model for `shape` at TP degree `tp_size`, on the CPU, from the default RNG
    (identical on every rank, so the TP shards of a TP=2 model slice the TP=1 weights)."""
    size = get_size(name)
    model = size.family.build(size.spec, shape, tp_size, options)
    if options.compile:
        compiled.compile_blocks(model.transformer_blocks())
    return model
