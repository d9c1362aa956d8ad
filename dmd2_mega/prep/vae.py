"""`LatentVAE`: a diffusers VAE folder as (pixels in [-1, 1]) <-> (normalised latents), both directions.

Two kinds, picked by `_class_name` in the folder's config.json:
    "wan"  AutoencoderKLWan  pixels [B, 3, T, H, W] <-> latents [B, z_dim, 1 + (T - 1) / tf, H / sf, W / sf]
    "kl"   AutoencoderKL     pixels [B, 3, H, W]    <-> latents [B, latent_channels, H / sf, W / sf]
with sf = 2^(number of spatial downsamplings) (x patch_size for Wan 2.2's VAE) and tf = 2^(number of
temporal downsamplings) (4 for Wan 2.1: T = 4k + 1 frames; the Wan encoder reads the clip as 1 + 4 + 4 ...
frame chunks, so T - 1 must be a multiple of 4 too).

Normalisation (z = what the flow model sees, x = the posterior mean, or a draw mean + std * eps):
    wan  z = (x - latents_mean) / latents_std          per channel; WanPipeline decodes x = z * std + mean
    kl   z = (x - latents_mean) * scaling / latents_std   when the config has latents_mean/std (SDXL-style),
         z = (x - shift_factor) * scaling              when it has shift_factor (SD3 / Flux),
         z = x * scaling                               otherwise (SD 1.x, DiT's sd-vae-ft-*)
`decode` inverts it and clamps pixels to [-1, 1]. `VAESpec` holds what the config alone tells (kind,
channels, factors, the size rules), so flags are checked before any weights load.
"""
import os
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from dmd2_mega.errors import ConfigError
from dmd2_mega.files.json_file import read_json

CLASSES = {"AutoencoderKLWan": "wan", "AutoencoderKL": "kl"}
VIDEO_CLASSES = ("AutoencoderKLWan",)
"""The classes whose latents have a time axis: pixels [B, 3, T, H, W] <-> latents [B, C, T', H', W']."""


def _read_config(path: str, flag: str) -> dict:
    if not path or not os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: not a directory (expected a diffusers VAE folder with config.json "
                          f"and weights, e.g. <pipeline>/vae)")
    where = os.path.join(path, "config.json")
    if not os.path.isfile(where):
        raise ConfigError(f"{flag} {path}: no config.json (expected a diffusers VAE folder saved by save_pretrained)")
    config = read_json(where, flag)
    name = config.get("_class_name")
    if name not in CLASSES:
        raise ConfigError(f"{flag} {where}: _class_name {name!r} is not a supported VAE; expected one of "
                          f"{sorted(CLASSES)}")
    return config


def _channel_stats(config: dict, key: str, channels: int, where: str) -> Optional[torch.Tensor]:
    value = config.get(key)
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == channels and all(isinstance(v, (int, float)) for v in value)):
        raise ConfigError(f"{where}: '{key}' must be a list of {channels} numbers (one per latent channel), "
                          f"found {value!r}")
    return torch.tensor(value, dtype=torch.float32)


@dataclass(frozen=True)
class VAESpec:
    """What a VAE folder's config.json says: its kind, latent channels, size factors and normalisation."""
    path: str
    flag: str
    class_name: str
    kind: str                       # "wan" or "kl"
    latent_channels: int
    spatial_factor: int
    temporal_factor: int            # 1 for "kl"
    mean: Optional[torch.Tensor]    # [C] float32 or None
    std: Optional[torch.Tensor]     # [C] float32 or None
    scaling: float                  # 1.0 for "wan"
    shift: float                    # 0.0 unless the config has shift_factor

    @classmethod
    def from_folder(cls, path: str, flag: str = "--vae") -> "VAESpec":
        config = _read_config(path, flag)
        where = os.path.join(path, "config.json")
        name = config["_class_name"]
        kind = CLASSES[name]
        if name in VIDEO_CLASSES:
            channels = int(config.get("z_dim", 16))
            dim_mult = config.get("dim_mult", [1, 2, 4, 4])
            down_t = config.get("temperal_downsample", [False, True, True])  # diffusers' spelling
            spatial = 2 ** (len(dim_mult) - 1) * int(config.get("patch_size") or 1)
            temporal = 2 ** sum(bool(t) for t in down_t)
            mean = _channel_stats(config, "latents_mean", channels, where)
            std = _channel_stats(config, "latents_std", channels, where)
            if mean is None or std is None:
                raise ConfigError(f"{flag} {where}: an AutoencoderKLWan config needs latents_mean and latents_std "
                                  f"(WanPipeline un-normalises with them)")
            scaling, shift = 1.0, 0.0
        else:
            channels = int(config.get("latent_channels", 4))
            spatial = 2 ** (len(config.get("block_out_channels", [64])) - 1)
            temporal = 1
            mean = _channel_stats(config, "latents_mean", channels, where)
            std = _channel_stats(config, "latents_std", channels, where)
            if (mean is None) != (std is None):
                raise ConfigError(f"{flag} {where}: latents_mean and latents_std must both be set or both be null")
            scaling = float(config.get("scaling_factor", 0.18215))
            shift = float(config.get("shift_factor") or 0.0)
        if std is not None and not bool((std > 0).all()):
            raise ConfigError(f"{flag} {where}: latents_std must be positive, found {std.tolist()}")
        return cls(path, flag, name, kind, channels, spatial, temporal, mean, std, scaling, shift)

    @property
    def video(self) -> bool:
        """Whether its latents have a time axis (a video VAE), or are images."""
        return self.class_name in VIDEO_CLASSES

    def check_size(self, frames: int, height: int, width: int) -> None:
        """Raise ConfigError naming --frames / --height / --width when the VAE cannot take that size."""
        sf = self.spatial_factor
        for name, value in (("--height", height), ("--width", width)):
            if not isinstance(value, int) or value < sf or value % sf:
                raise ConfigError(f"{name} {value}: the VAE ({self.flag} {self.path}, {self.class_name}) needs a "
                                  f"positive multiple of its spatial factor {sf}")
        if self.video:
            step = max(4, self.temporal_factor)  # the encoder's 1 + 4 + 4 ... chunks and its temporal factor
            if not isinstance(frames, int) or frames < 1 or (frames - 1) % step:
                raise ConfigError(f"--frames {frames}: the VAE ({self.flag} {self.path}, {self.class_name}) needs "
                                  f"{step}k + 1 frames (1, {1 + step}, {1 + 2 * step}, ..., 81)")
        elif frames != 1:
            raise ConfigError(f"--frames {frames}: the VAE ({self.flag} {self.path}, {self.class_name}) is an image "
                              f"VAE; it takes 1 frame")

    def latent_shape(self, frames: int, height: int, width: int) -> Tuple[int, ...]:
        """The latent of one sample: (C, T', H', W') for "wan", (C, H', W') for "kl" (the size is checked first)."""
        self.check_size(frames, height, width)
        hw = (height // self.spatial_factor, width // self.spatial_factor)
        if self.video:
            return (self.latent_channels, 1 + (frames - 1) // self.temporal_factor, *hw)
        return (self.latent_channels, *hw)

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """Raw VAE latents [B, C, ...] -> the normalised latents (float32)."""
        x = x.float()
        view = (1, -1) + (1,) * (x.dim() - 2)
        if self.mean is not None:
            mean, std = self.mean.to(x.device).view(view), self.std.to(x.device).view(view)
            return (x - mean) * self.scaling / std
        return (x - self.shift) * self.scaling

    def denormalise(self, z: torch.Tensor) -> torch.Tensor:
        """Normalised latents [B, C, ...] -> raw VAE latents (float32); the inverse of `normalise`."""
        z = z.float()
        view = (1, -1) + (1,) * (z.dim() - 2)
        if self.mean is not None:
            mean, std = self.mean.to(z.device).view(view), self.std.to(z.device).view(view)
            return z * std / self.scaling + mean
        return z / self.scaling + self.shift


class LatentVAE:
    """A loaded diffusers VAE: `encode(pixels) -> normalised latents`, `decode(latents) -> pixels`, no grad."""

    def __init__(self, spec: VAESpec, model: torch.nn.Module, device: torch.device, dtype: torch.dtype):
        self.spec, self.model, self.device, self.dtype = spec, model, device, dtype

    @classmethod
    def from_folder(cls, path: str, device="cpu", dtype: torch.dtype = torch.float32,
                    flag: str = "--vae") -> "LatentVAE":
        spec = VAESpec.from_folder(path, flag)
        import diffusers  # deferred: diffusers is heavy and only needed once weights load
        try:
            model = getattr(diffusers, spec.class_name).from_pretrained(path, torch_dtype=dtype, local_files_only=True)
        except (OSError, ValueError, RuntimeError) as e:
            raise ConfigError(f"{flag} {path}: cannot load {spec.class_name} weights ({e})") from e
        device = torch.device(device)
        return cls(spec, model.to(device).eval().requires_grad_(False), device, dtype)

    kind = property(lambda self: self.spec.kind)
    video = property(lambda self: self.spec.video)
    latent_channels = property(lambda self: self.spec.latent_channels)
    spatial_factor = property(lambda self: self.spec.spatial_factor)
    temporal_factor = property(lambda self: self.spec.temporal_factor)

    def check_size(self, frames: int, height: int, width: int) -> None:
        self.spec.check_size(frames, height, width)

    def latent_shape(self, frames: int, height: int, width: int) -> tuple:
        return self.spec.latent_shape(frames, height, width)

    def _check_layout(self, t: torch.Tensor, what: str, channels: int) -> None:
        dims = 5 if self.video else 4
        if t.dim() != dims or t.shape[1] != channels:
            layout = "[B, C, T, H, W]" if dims == 5 else "[B, C, H, W]"
            raise ConfigError(f"LatentVAE.{what}: expected {layout} with C = {channels} for a {self.spec.class_name}, "
                              f"got shape {list(t.shape)}")

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor, noise: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Pixels in [-1, 1] -> normalised latents (float32). The posterior mean, or mean + std * noise
        when `noise` (standard normal, the latent's shape) is given (a posterior draw)."""
        self._check_layout(pixels, "encode", 3)
        _, _, *size = pixels.shape
        frames = size[0] if self.video else 1
        self.check_size(frames, *size[-2:])
        posterior = self.model.encode(pixels.to(self.device, self.dtype)).latent_dist
        x = posterior.mean.float()
        if noise is not None:
            if tuple(noise.shape) != tuple(x.shape):
                raise ConfigError(f"LatentVAE.encode: noise must have the latent shape {list(x.shape)}, "
                                  f"got {list(noise.shape)}")
            x = x + posterior.std.float() * noise.to(x.device, torch.float32)
        return self.spec.normalise(x)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents -> pixels in [-1, 1] (float32), same layout as `encode`'s input."""
        self._check_layout(latents, "decode", self.latent_channels)
        raw = self.spec.denormalise(latents.to(self.device)).to(self.dtype)
        return self.model.decode(raw).sample.float().clamp(-1, 1)

    def stream_decoder(self) -> "StreamDecoder":
        """A decoder of one video's latents chunk by chunk (a causal student's stream): `StreamDecoder`."""
        return StreamDecoder(self)


class StreamDecoder:
    """Decodes a video's latents chunk by chunk, keeping the Wan VAE's causal convolution cache between chunks, as
    `AutoencoderKLWan.decode` does between the frames of a whole clip (it decodes latent frame by frame, the first
    one as its own "first chunk"): the chunks' frames joined are the whole clip's decode. One decoder per batch of
    videos, its chunks in order; the VAE's own `decode` must not run in between (it clears the cache). Uses
    diffusers' per-frame decoder step and cache (`_feat_map`, `_conv_idx`), checked present at construction."""

    def __init__(self, vae: LatentVAE):
        m = vae.model
        if not vae.video or not all(hasattr(m, a) for a in ("clear_cache", "decoder", "post_quant_conv")):
            raise ConfigError(f"a {vae.spec.class_name} has no causal decoder cache to decode a stream chunk by chunk")
        self.vae, self.first = vae, True
        m.clear_cache()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """The next chunk's normalised latents [B, C, f, h, w] -> its pixels [B, 3, frames, H, W] in [-1, 1]."""
        vae, m = self.vae, self.vae.model
        vae._check_layout(latents, "decode", vae.latent_channels)
        x = m.post_quant_conv(vae.spec.denormalise(latents.to(vae.device)).to(vae.dtype))
        out = []
        for i in range(x.shape[2]):
            m._conv_idx = [0]
            step = x[:, :, i:i + 1]
            out.append(m.decoder(step, feat_cache=m._feat_map, feat_idx=m._conv_idx, first_chunk=True) if self.first
                       else m.decoder(step, feat_cache=m._feat_map, feat_idx=m._conv_idx))
            self.first = False
        pixels = torch.cat(out, 2)
        if getattr(m.config, "patch_size", None) is not None:
            from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify
            pixels = unpatchify(pixels, patch_size=m.config.patch_size)
        return pixels.float().clamp(-1, 1)


__all__: Sequence[str] = ("LatentVAE", "StreamDecoder", "VAESpec", "CLASSES")
