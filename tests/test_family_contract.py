"""The model-family contract (`models/family.py`): every registered size belongs to a family of `FAMILIES`, a
family recognises its own config files and not another's, and a path no family recognises is one ConfigError
naming the path and every family tried (never a fall-through to a default family)."""
import json
import os
from dataclasses import replace

import pytest

from dmd2_mega.errors import ConfigError
from dmd2_mega.models import FAMILIES, MODEL_SIZES, ModelFamily, family_of, get_size, get_spec, source_family
from dmd2_mega.models.dit.checkpoints import diffusers_config, our_config


def test_every_size_is_a_registered_family_and_its_spec_finds_it():
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)
    for name, size in MODEL_SIZES.items():
        assert isinstance(size.family, ModelFamily) and size.family in FAMILIES, name
        assert family_of(size.spec) is size.family, name
        assert size.family_name == size.family.name  # the tag checkpoints record
    with pytest.raises(ConfigError, match="the spec of no model family"):
        family_of(object())


def _folder(path, config: dict) -> str:
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def test_each_family_recognises_its_configs_and_no_other(tmp_path):
    wan = get_spec("wan-debug")
    dit = replace(get_spec("debug"), in_channels=4, sample_size=8, num_classes=10, pos_table="dit", freq_shift=1)
    folders = {"wan": _folder(tmp_path / "wan", wan.diffusers_config()),
               "dit-ours": _folder(tmp_path / "ours", our_config(dit)),
               "dit-diffusers": _folder(tmp_path / "diffusers", diffusers_config(dit))}
    for kind, folder in folders.items():
        family = get_size(folder).family
        assert family.name == kind.split("-")[0], kind
        config = os.path.join(folder, "config.json")
        others = [f for f in FAMILIES if f is not family]
        assert all(f.recognise(config, folder, folder) is None for f in others), kind
    assert replace(get_spec(folders["wan"]), name="") == replace(wan, name="")
    assert replace(get_spec(folders["dit-ours"]), name="") == replace(dit, name="")
    assert source_family(folders["wan"]).name == "wan" and source_family(folders["dit-diffusers"]).name == "dit"


def test_a_folder_no_family_recognises_is_one_line_naming_the_families(tmp_path):
    folder = _folder(tmp_path / "pixart", {"_class_name": "PixArtTransformer2DModel"})
    for call, what in ((get_size, "recognises"), (source_family, "reads")):
        with pytest.raises(ConfigError) as e:
            call(folder)
        msg = str(e.value)
        assert "\n" not in msg and folder in msg and f"no model family {what}" in msg, msg
        assert "'PixArtTransformer2DModel'" in msg and "tried " + "; ".join(f.reads for f in FAMILIES) in msg, msg
    unread = _folder(tmp_path / "nothing", {"num_layers": 2})
    with pytest.raises(ConfigError, match=r"no _class_name\); tried dit: "):
        get_size(unread)
