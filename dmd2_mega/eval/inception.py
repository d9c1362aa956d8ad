"""The Inception-v3 feature network of FID, loaded from a local file (nothing is ever downloaded).

Supported file: `inception-2015-12-05.pt`, the TorchScript translation of TensorFlow's 2015-12-05 Inception
graph that NVlabs ships for StyleGAN2-ADA (`INCEPTION_URL`) and that clean-fid and tianweiy/DMD2's COCO
evaluation load from the same address (StyleGAN3 and EDM load the same translation from a pickle,
`inception-2015-12-05.pkl`).
Its call convention, as StyleGAN3's `metrics/metric_utils.py` and clean-fid's `inception_torchscript.py`
(mode "legacy_tensorflow") use it:

    features = net(images, return_features=True)     images [B, 3, H, W], uint8 (or float) in [0, 255]
                                                      features [B, 2048] float32: pool3, before the logits

The network casts to float32, resizes to 299 x 299 (bilinear) and normalises to [-1, 1] inside, so any image
size goes in as it is; grey images are repeated to 3 channels by the caller (StyleGAN3 does the same).

Any TorchScript module with that signature, `forward(self, img, return_features: bool = False)`, loads the
same way; the feature width D is read by probing it once with 2 black images. Other layouts are refused with
a one-line ConfigError naming the file: a plain state dict (torch-fidelity's
`weights-inception-2015-12-05-6726825d.pth`, pytorch-fid's `pt_inception-2015-12-05-6726825d.pth`) needs the
Python InceptionV3 class of its package, and a pickle (StyleGAN3's .pkl) is not loaded, to run no pickled code.
"""
from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from typing import Tuple

import torch

from dmd2_mega.errors import ConfigError

INCEPTION_URL = "https://nvlabs-fi-cdn.nvidia.com/stylegan2-ada-pytorch/pretrained/metrics/inception-2015-12-05.pt"
"""Where inception-2015-12-05.pt comes from (StyleGAN2-ADA's metrics; clean-fid downloads the same file)."""
FILE_NAME = "inception-2015-12-05.pt"


def _get_it(flag: str) -> str:
    return (f"download {FILE_NAME} (the TorchScript Inception-v3 of StyleGAN2-ADA / StyleGAN3 / clean-fid) from "
            f"{INCEPTION_URL} once and pass its path to {flag}; nothing is downloaded at run time")


def check_inception_file(path: str, flag: str = "--inception-weights") -> None:
    """ConfigError unless `path` is a TorchScript archive (checked from the zip's member names, without loading):
    a missing file names where to get it; a state dict or a pickle names the file to use instead."""
    if not path or not os.path.isfile(path):
        what = "is a directory" if path and os.path.isdir(path) else "does not exist"
        raise ConfigError(f"{flag} {path} {what}: {_get_it(flag)}")
    if not zipfile.is_zipfile(path):
        raise ConfigError(f"{flag} {path} is not a TorchScript archive (a pickle such as StyleGAN3's "
                          f"inception-2015-12-05.pkl, or a truncated file?): {_get_it(flag)}")
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError) as e:
        raise ConfigError(f"{flag} {path} is unreadable ({e}): {_get_it(flag)}") from e
    if not any("/code/" in n or n.endswith(("constants.pkl", "model.json")) for n in names):
        raise ConfigError(f"{flag} {path} holds a plain state dict (a torch.save archive), not a TorchScript module: "
                          f"torch-fidelity's / pytorch-fid's Inception weights are not supported; "
                          f"{_get_it(flag)}")


@dataclass
class InceptionFeatures:
    """A loaded feature network: `self(images uint8 [B, 3, H, W]) -> features float64 [B, width]`."""
    net: torch.jit.ScriptModule
    path: str
    width: int
    device: torch.device

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images.to(self.device), return_features=True).double()


def load_inception(path: str, device, image_size: Tuple[int, int], flag: str = "--inception-weights"
                   ) -> InceptionFeatures:
    """Load `path` with torch.jit.load on `device` and probe it with 2 black uint8 images of `image_size` (H, W):
    ConfigError naming the file when it does not load, does not take (images, return_features=True) or returns
    anything but [2, D] features."""
    check_inception_file(path, flag)
    device = torch.device(device)
    try:
        net = torch.jit.load(path, map_location=device).eval()
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"{flag} {path}: torch.jit.load failed ({' '.join(str(e).split())[:300]})") from e
    probe = torch.zeros((2, 3, *image_size), dtype=torch.uint8, device=device)
    try:
        with torch.no_grad():
            out = net(probe, return_features=True)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"{flag} {path}: the module does not take net(images uint8 [B, 3, H, W], "
                          f"return_features=True) ({' '.join(str(e).split())[:300]})") from e
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != 2:
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(f"{flag} {path}: net(images [2, 3, {image_size[0]}, {image_size[1]}], "
                          f"return_features=True) returned {got}; expected features [2, D]")
    return InceptionFeatures(net, path, int(out.shape[1]), device)
