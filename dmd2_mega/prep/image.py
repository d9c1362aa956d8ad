"""Image-to-video (I2V) conditions for `launch/prepare_data.py`: which form a Wan pipeline reads, and each clip's
flat condition (the forms: models/wan/image.py).

The form (`resolve_image`, from config files only, before any weights load):
    concat       the transformer's in_channels = 2 out_channels + 4 (Wan 2.1 I2V, Wan 2.2 I2V A14B), or
                 model_index.json names WanImageToVideoPipeline with expand_timesteps false
    first-frame  model_index.json names WanImageToVideoPipeline with expand_timesteps true and in_channels =
                 out_channels (Wan 2.2 TI2V-5B's image mode)
`--image-condition FORM` names the form without a pipeline folder, or for a text-to-video folder read in TI2V's
image mode (first-frame); it must agree with what the folder says. A folder that contradicts itself, or a flag that
contradicts the folder, is a ConfigError. CLIP embeddings are stored when the transformer has `image_dim` (Wan 2.1
I2V; without a transformer config: when there is an image encoder), from <pipeline>/image_encoder and
image_processor, or --image-encoder / --image-processor.
Per clip, with `first` its first frame after media.py's resize and crop (uint8 [H, W, 3]):
    clip   [Li, Di]       image_encoder(**image_processor(images=first), output_hidden_states=True).hidden_states[-2]
                          (WanImageToVideoPipeline.encode_image); Li = (image_size / patch_size)^2 + 1 (257 for
                          ViT-H/14 at 224), Di = hidden_size (1280)
    image  concat         [C, T', H', W'] = normalised posterior mean of vae.encode([first, 0, ..., 0]), --frames long
           first-frame    [C, 1, H', W']  = normalised posterior mean of vae.encode([first])
                          (WanImageToVideoPipeline.prepare_latents' latent_condition: sample_mode "argmax", pixels
                          x / 127.5 - 1, (x - latents_mean) / latents_std; never a posterior draw). The concat form's
                          mask channels are not stored: they are models/wan/image.concat_mask of the image latent.
    cond   [L * D (+ Li * Di) + numel(image)] = cat(text.flatten(), clip.flatten(), image.flatten())
with parts (("text", [L, D]), ("clip", [Li, Di]), ("image", [...])): index.json's "cond_parts". The negative
prompt stays text only, [L, D] (CFG's negative keeps each sample's image: CondParts.with_text).

`--images FILE` (with --prompts-only; `read_image_prompts`): the eval conditions, one image and one prompt per row,
in the captions file's formats (clips.py): a CSV with the columns `path` and `caption`, or JSON lines with those
keys. A relative path is relative to --media when given, else to the file's folder; images and videos (their
first frame) are read at --height x --width as the clips are. Rows keep the file's order; an image may repeat.
"""
import importlib.util
import math
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from dmd2_mega.errors import ConfigError, DataError
from dmd2_mega.files.json_file import read_json

from .clips import read_rows
from .media import IMAGE_EXT, VIDEO_EXT, load_clip
from .vae import LatentVAE, VAESpec

FORMS = ("concat", "first-frame")
MASK_CHANNELS = 4
"""models/wan/image.MASK_CHANNELS (not imported: the models package loads the training stack)."""
I2V_PIPELINE = "WanImageToVideoPipeline"
CLIP_TYPES = ("clip_vision_model", "clip")
PROCESSOR_FILE = "preprocessor_config.json"


@dataclass(frozen=True)
class ImageSpec:
    """What the image adds to each clip's condition: the form, why it was chosen, and the CLIP part."""
    form: str                               # "concat" or "first-frame"
    why: str                                # the evidence, in words (the summary line)
    encoder: Optional[str] = None           # the CLIPVisionModel folder (Wan 2.1 I2V), else None
    processor: Optional[str] = None         # its CLIPImageProcessor folder
    clip: Optional[Tuple[int, int]] = None  # (Li, Di) of the stored CLIP embedding, else None

    def image_shape(self, latent_shape: Sequence[int]) -> tuple:
        """The image latent of a clip whose latents are [C, T', H', W']."""
        c, _, h, w = latent_shape
        return tuple(latent_shape) if self.form == "concat" else (c, 1, h, w)

    def parts(self, text_shape: Sequence[int], latent_shape: Sequence[int]) -> tuple:
        """(("text", [L, D]), ("clip", [Li, Di])?, ("image", [...])): the flat condition's layout."""
        clip = (("clip", tuple(self.clip)),) if self.clip else ()
        return (("text", tuple(text_shape)), *clip, ("image", self.image_shape(latent_shape)))

    def numel(self, latent_shape: Sequence[int]) -> int:
        """The values the image adds to the flat condition: the CLIP embedding's and the image latent's."""
        return (math.prod(self.clip) if self.clip else 0) + math.prod(self.image_shape(latent_shape))

    def describe(self) -> str:
        clip = f", CLIP {list(self.clip)} from {self.encoder}" if self.clip else ", no CLIP embedding"
        return f"image condition: {self.form} ({self.why}){clip}"


def _transformer(pipeline: str) -> Tuple[Optional[str], Optional[dict]]:
    """(its name, config.json) of the pipeline's transformer/ (or transformer_2/ alone), or (None, None)."""
    for sub in ("transformer", "transformer_2"):
        where = os.path.join(pipeline, sub, "config.json")
        if os.path.isfile(where):
            cfg = read_json(where, "--pipeline")
            cin, cout = cfg.get("in_channels"), cfg.get("out_channels", cfg.get("in_channels"))
            if not (isinstance(cin, int) and isinstance(cout, int) and cin > 0 and cout > 0):
                raise ConfigError(f"--pipeline {where}: in_channels / out_channels must be positive ints, found "
                                  f"{cin!r} / {cout!r}")
            return sub, {**cfg, "out_channels": cout}
    return None, None


def _folder_form(pipeline: str, index: dict, name: Optional[str], tcfg: Optional[dict]) -> Tuple[Optional[str], str]:
    """(the form the pipeline folder says, or None for text to video; the evidence in words). Only the folders of
    WanPipeline / WanImageToVideoPipeline (or with no model_index.json) are read: another pipeline's transformer is
    not ours to interpret."""
    cls = index.get("_class_name")
    if cls not in (None, "WanPipeline", I2V_PIPELINE):
        return None, f"model_index.json names {cls}"
    expand = index.get("expand_timesteps") is True
    said = ("first-frame" if expand else "concat") if cls == I2V_PIPELINE else None
    said_why = f"model_index.json: {I2V_PIPELINE}, expand_timesteps {'true' if expand else 'false'}"
    if tcfg is None:
        return said, said_why if said else ""
    cin, cout = tcfg["in_channels"], tcfg["out_channels"]
    if cin == 2 * cout + MASK_CHANNELS:
        reads, why = "concat", f"{name} in_channels {cin} = 2 x {cout} + {MASK_CHANNELS}"
    elif cin == cout:
        reads, why = "first-frame", f"{name} in_channels {cin} = out_channels"
    elif said is None:
        return None, f"{name} in_channels {cin}, out_channels {cout}"
    else:
        raise ConfigError(f"--pipeline {pipeline}: {name}/config.json in_channels {cin} is neither out_channels "
                          f"{cout} (TI2V's first-frame form) nor 2 x {cout} + {MASK_CHANNELS} (the concat form)")
    if said is not None and said != reads:
        raise ConfigError(f"--pipeline {pipeline}: {said_why} (the {said} form), but {why} (the {reads} form): "
                          f"the folder contradicts itself")
    if said == "first-frame":
        return said, f"{said_why}, {why}"
    return ("concat", why) if reads == "concat" else (None, why)  # in = out: text to video unless a flag says


def resolve_image(pipeline: Optional[str], form: Optional[str], encoder: Optional[str], processor: Optional[str],
                  vae: Optional[VAESpec]) -> Optional[ImageSpec]:
    """The image condition of these flags (module docstring), None for text-only data; config files only."""
    if form is not None and form not in FORMS:
        raise ConfigError(f"--image-condition {form}: expected one of {', '.join(FORMS)}")
    index = {}
    if pipeline and os.path.isfile(os.path.join(pipeline, "model_index.json")):
        index = read_json(os.path.join(pipeline, "model_index.json"), "--pipeline")
    name, tcfg = _transformer(pipeline) if pipeline else (None, None)
    found, why = _folder_form(pipeline, index, name, tcfg) if pipeline else (None, "")
    if form is not None and found is not None and form != found:
        raise ConfigError(f"--image-condition {form}: --pipeline {pipeline} reads the {found} form ({why}); drop the "
                          f"flag or pass --image-condition {found}")
    if form is not None and found is None and tcfg is not None:
        cin, cout = tcfg["in_channels"], tcfg["out_channels"]
        if cin != (2 * cout + MASK_CHANNELS if form == "concat" else cout):
            need = f"2 x {cout} + {MASK_CHANNELS}" if form == "concat" else f"out_channels {cout}"
            raise ConfigError(f"--image-condition {form}: --pipeline {pipeline} has {why}; the {form} form needs "
                              f"in_channels = {need}")
    if form is not None and found is None:
        why = f"--image-condition {form}" + (f"; {why}" if why else "")
    form = form or found
    if form is None:
        given = [f for f, v in (("--image-encoder", encoder), ("--image-processor", processor)) if v]
        if given:
            raise ConfigError(f"{' '.join(given)}: goes with an image-to-video pipeline ({I2V_PIPELINE}) or "
                              f"--image-condition {{{','.join(FORMS)}}}")
        return None
    if vae is not None:
        _check_vae(vae, form, name, tcfg)
    encoder, processor, clip = _clip(pipeline, index, form, encoder, processor, name, tcfg)
    return ImageSpec(form, why, encoder, processor, clip)


def _check_vae(vae: VAESpec, form: str, name: Optional[str], tcfg: Optional[dict]) -> None:
    if not vae.video:
        raise ConfigError(f"{vae.flag} {vae.path}: {vae.class_name} is an image VAE; the {form} image-to-video form "
                          f"encodes video with an AutoencoderKLWan")
    if tcfg is not None and tcfg["out_channels"] != vae.latent_channels:
        raise ConfigError(f"{vae.flag} {vae.path}: {vae.latent_channels} latent channels, but the pipeline's {name} "
                          f"has out_channels {tcfg['out_channels']}")


def _clip(pipeline, index, form, encoder, processor, name, tcfg) -> tuple:
    """(encoder folder, processor folder, (Li, Di)) of the CLIP part, or (None, None, None)."""
    own = os.path.join(pipeline, "image_encoder") if pipeline else None
    listed = (index.get("image_encoder") or [None])[0] is not None or "image_encoder" not in index  # [null, null]
    found = own if own and listed and os.path.isdir(own) else None
    image_dim = tcfg.get("image_dim") if tcfg is not None else None
    given = [f for f, v in (("--image-encoder", encoder), ("--image-processor", processor)) if v]
    if form == "first-frame" or (tcfg is not None and image_dim is None):
        if given:
            why = ("the first-frame form (TI2V)" if form == "first-frame" else
                   f"the pipeline's {name} (no image_dim: Wan 2.2 I2V)")
            raise ConfigError(f"{' '.join(given)}: {why} reads no CLIP image embedding; drop {' '.join(given)}")
        return None, None, None
    encoder = encoder or found
    if encoder is None:
        if image_dim is not None:
            raise ConfigError(f"--image-encoder: the pipeline's {name}/config.json has image_dim {image_dim} (Wan 2.1 "
                              f"I2V reads CLIP image embeddings), but there is no {own}; pass --image-encoder DIR "
                              f"(a transformers CLIPVisionModel folder)")
        if processor:
            raise ConfigError("--image-processor goes with --image-encoder DIR (the CLIP embeddings of Wan 2.1 I2V)")
        return None, None, None
    if not os.path.isdir(encoder):
        raise ConfigError(f"--image-encoder {encoder}: not a directory (expected a transformers CLIPVisionModel "
                          f"folder, e.g. <pipeline>/image_encoder)")
    cfg = read_json(os.path.join(encoder, "config.json"), "--image-encoder")
    vision = cfg.get("vision_config") if cfg.get("model_type") == "clip" else cfg
    dims = [vision.get(k) for k in ("hidden_size", "image_size", "patch_size")] if isinstance(vision, dict) else []
    if cfg.get("model_type") not in CLIP_TYPES or not all(isinstance(v, int) and v > 0 for v in dims):
        raise ConfigError(f"--image-encoder {encoder}: config.json model_type {cfg.get('model_type')!r}; expected a "
                          f"CLIP vision model ({' or '.join(CLIP_TYPES)}) with int hidden_size, image_size, patch_size")
    hidden, size, patch = dims
    if image_dim is not None and hidden != image_dim:
        raise ConfigError(f"--image-encoder {encoder}: hidden_size {hidden}, but the pipeline's {name} reads CLIP "
                          f"embeddings of image_dim {image_dim}")
    processor = _processor_folder(encoder, processor, size)
    return encoder, processor, ((size // patch) ** 2 + 1, hidden)


def _processor_folder(encoder: str, processor: Optional[str], size: int) -> str:
    """--image-processor, else the encoder folder or its sibling image_processor/ (a pipeline's); its output size
    checked against the encoder's image_size."""
    sibling = os.path.join(os.path.dirname(os.path.abspath(encoder)), "image_processor")
    if processor is None:
        processor = next((d for d in (encoder, sibling) if os.path.isfile(os.path.join(d, PROCESSOR_FILE))), None)
        if processor is None:
            raise ConfigError(f"--image-processor: not given, and neither --image-encoder {encoder} nor {sibling} "
                              f"holds a {PROCESSOR_FILE}; pass --image-processor DIR")
    where = os.path.join(processor, PROCESSOR_FILE)
    if not os.path.isfile(where):
        raise ConfigError(f"--image-processor {processor}: no {PROCESSOR_FILE} (expected a transformers "
                          f"CLIPImageProcessor folder, e.g. <pipeline>/image_processor)")
    cfg = read_json(where, "--image-processor")
    crop = cfg.get("crop_size") if cfg.get("do_center_crop", True) else cfg.get("size")
    hw = (crop, crop) if isinstance(crop, int) else (crop.get("height"), crop.get("width")) \
        if isinstance(crop, dict) else (None, None)
    if None not in hw and hw != (size, size):
        raise ConfigError(f"--image-processor {processor}: makes {hw[0]} x {hw[1]} images, but the image encoder "
                          f"reads image_size {size}")
    return processor


class ImageConditioner:
    """The loaded image side: `encode(first frames) -> [B, Li * Di + numel(image)]` (the condition after the text)."""

    def __init__(self, spec: ImageSpec, vae: LatentVAE, clip: Optional[torch.nn.Module], processor):
        self.spec, self.vae, self.clip, self.processor = spec, vae, clip, processor

    @classmethod
    def load(cls, spec: ImageSpec, vae: LatentVAE) -> "ImageConditioner":
        """CLIP (when spec has it) on the VAE's device and dtype."""
        if not spec.clip:
            return cls(spec, vae, None, None)
        import transformers  # deferred: heavy, and only needed once weights load
        # CLIPImageProcessor is torchvision's since transformers 5; without torchvision it falls back (with a
        # warning) to the Pillow one, which this picks directly
        name = ("CLIPImageProcessor" if importlib.util.find_spec("torchvision") is not None
                or not hasattr(transformers, "CLIPImageProcessorPil") else "CLIPImageProcessorPil")
        try:
            processor = getattr(transformers, name).from_pretrained(spec.processor, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--image-processor {spec.processor}: cannot load {name} ({e})") from e
        try:
            model = transformers.CLIPVisionModel.from_pretrained(spec.encoder, dtype=vae.dtype, local_files_only=True)
        except (OSError, ValueError, RuntimeError) as e:
            raise ConfigError(f"--image-encoder {spec.encoder}: cannot load CLIPVisionModel weights ({e})") from e
        return cls(spec, vae, model.to(vae.device).eval().requires_grad_(False), processor)

    @torch.no_grad()
    def encode(self, first: torch.Tensor, frames: int) -> torch.Tensor:
        """First frames uint8 [B, H, W, 3] of --frames-long clips -> float32 [B, Li * Di + numel(image)]: the CLIP
        embedding (when stored) and the image latent, flat (module docstring)."""
        b, h, w, _ = first.shape
        x = (first.to(self.vae.device).permute(0, 3, 1, 2).float() / 127.5 - 1.0)[:, :, None]  # [B, 3, 1, H, W]
        if self.spec.form == "concat" and frames > 1:
            x = torch.cat([x, x.new_zeros(b, 3, frames - 1, h, w)], dim=2)
        parts = [self.vae.encode(x).flatten(1).cpu()]
        if self.clip is not None:
            from PIL import Image
            inputs = self.processor(images=[Image.fromarray(f.numpy()) for f in first.cpu()], return_tensors="pt")
            pixels = inputs["pixel_values"].to(self.vae.device)
            hidden = self.clip(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
            if tuple(hidden.shape[1:]) != tuple(self.spec.clip):
                raise ConfigError(f"--image-encoder {self.spec.encoder}: CLIP embeddings {list(hidden.shape[1:])}, "
                                  f"expected {list(self.spec.clip)} from its config")
            parts.insert(0, hidden.float().flatten(1).cpu())
        return torch.cat(parts, dim=1)


def flat_condition(text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
    """text [B, L, D] and the image parts [B, n] -> cond [B, L * D + n] in text's dtype."""
    return torch.cat([text.flatten(1), image.to(text.dtype)], dim=1)


@dataclass(frozen=True)
class ImagePrompt:
    """One row of --images: the image (as written, and resolved) and its prompt."""
    line: int
    path: str
    file: str
    caption: str


def read_image_prompts(path: str, media: Optional[str] = None) -> List[ImagePrompt]:
    """The rows of the --images file in order (module docstring); a malformed row, an unknown extension or a missing
    image is a DataError naming the file and line."""
    if not path or not os.path.isfile(path):
        raise DataError(f"--images {path}: no such file (expected a CSV or JSONL with 'path' and 'caption', one "
                        f"image and prompt per row)")
    root = media if media else os.path.dirname(os.path.abspath(path))
    out = []
    for line, row, reason in read_rows(path, "--images"):
        if not reason:
            rel, caption = row.get("path"), row.get("caption")
            if not isinstance(rel, str) or not rel or not isinstance(caption, str):
                reason = f"'path' and 'caption' must be strings, found path={rel!r} caption={caption!r}"
        if reason:
            raise DataError(f"--images {path} line {line}: {reason}")
        if os.path.splitext(rel)[1].lower() not in IMAGE_EXT + VIDEO_EXT:
            raise DataError(f"--images {path} line {line}: {rel!r} is not an image or a video (expected one of "
                            f"{' '.join(IMAGE_EXT + VIDEO_EXT)})")
        file = rel if os.path.isabs(rel) else os.path.join(root, rel)
        if not os.path.isfile(file):
            where = "--media" if media else "the file's folder"
            raise DataError(f"--images {path} line {line}: image {rel!r} does not exist ({file}; relative paths are "
                            f"relative to {where})")
        out.append(ImagePrompt(line, rel, file, caption))
    if not out:
        raise DataError(f"--images {path}: no rows (expected 'path' and 'caption' per eval condition)")
    return out


def load_first_frames(prompts: Sequence[ImagePrompt], height: int, width: int, images_flag: str) -> torch.Tensor:
    """uint8 [P, height, width, 3]: each row's image (a video's first frame), resized and cropped as clips are."""
    frames = []
    for p in prompts:
        f, reason = load_clip(p.file, 1, height, width)
        if f is None:
            raise DataError(f"{images_flag} line {p.line}: image {p.path!r}: {reason}")
        frames.append(f[0])
    return torch.stack(frames)
