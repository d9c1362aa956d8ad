"""`TextEncoder`: captions -> per-token embeddings [B, L, D] + real lengths [B], exactly as WanPipeline.

Steps (diffusers `WanPipeline._get_t5_prompt_embeds` + `prompt_clean`, pipelines/wan/pipeline_wan.py):
    1. clean: ftfy.fix_text (only when ftfy is installed, as diffusers does), html-unescape twice, strip,
       collapse every whitespace run to one space, strip
    2. tokenise: padding="max_length", max_length=L (`--max-text-len`, WanPipeline's default 512),
       truncation=True, add_special_tokens=True (the closing </s>), with the attention mask
    3. length n_b = number of mask entries > 0 (the real tokens, </s> included)
    4. encode: encoder(input_ids, attention_mask).last_hidden_state  [B, L, D]
    5. keep positions t < n_b, zeros after (WanPipeline trims to n_b and re-pads with zeros)
`DEFAULT_NEGATIVE` is the negative prompt of WanPipeline's documented example (EXAMPLE_DOC_STRING in
pipeline_wan.py; the English form of Wan's own default `sample_neg_prompt`). `resolve_folders` checks the
encoder and tokenizer folders (config.json model_type umt5 / t5) before any weights load.
"""
import html
import os
import re
from typing import List, Optional, Sequence, Tuple

import torch

from dmd2_mega.errors import ConfigError
from dmd2_mega.files.json_file import read_json

try:  # diffusers runs ftfy.fix_text only when ftfy is importable; match it either way
    import ftfy
except ImportError:  # pragma: no cover - depends on the environment
    ftfy = None

DEFAULT_NEGATIVE = (
    "Bright tones, overexposed, static, blurred details, subtitles, style, works, paintings, images, static, "
    "overall gray, worst quality, low quality, JPEG compression residue, ugly, incomplete, extra fingers, poorly "
    "drawn hands, poorly drawn faces, deformed, disfigured, misshapen limbs, fused fingers, still picture, messy "
    "background, three legs, many people in the background, walking backwards")
ENCODERS = {"umt5": "UMT5EncoderModel", "t5": "T5EncoderModel"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "spiece.model")


def clean_prompt(text: str) -> str:
    """Step 1 of the module docstring."""
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


def resolve_folders(encoder: Optional[str], tokenizer: Optional[str] = None, flag: str = "--text-encoder",
                    tokenizer_flag: str = "--tokenizer") -> Tuple[str, str, dict]:
    """(encoder folder, tokenizer folder, the encoder's config.json), checked. The tokenizer defaults to the
    encoder folder when it holds tokenizer files, else to a sibling `tokenizer/` (a diffusers pipeline folder)."""
    if not encoder or not os.path.isdir(encoder):
        raise ConfigError(f"{flag} {encoder}: not a directory (expected a transformers UMT5 / T5 encoder folder "
                          f"with config.json, e.g. <pipeline>/text_encoder)")
    where = os.path.join(encoder, "config.json")
    config = read_json(where, flag)
    model_type = config.get("model_type")
    if model_type not in ENCODERS or not isinstance(config.get("d_model"), int):
        raise ConfigError(f"{flag} {where}: model_type {model_type!r} is not supported; expected one of "
                          f"{sorted(ENCODERS)} (Wan uses umt5) with an int d_model")
    if tokenizer is None:
        sibling = os.path.join(os.path.dirname(os.path.abspath(encoder)), "tokenizer")
        if any(os.path.isfile(os.path.join(encoder, f)) for f in TOKENIZER_FILES):
            tokenizer = encoder
        elif os.path.isdir(sibling):
            tokenizer = sibling
        else:
            raise ConfigError(f"{tokenizer_flag}: not given, and neither {flag} {encoder} nor a sibling "
                              f"{sibling} holds a tokenizer; pass {tokenizer_flag} DIR")
    if not os.path.isdir(tokenizer) or not any(os.path.isfile(os.path.join(tokenizer, f)) for f in TOKENIZER_FILES):
        raise ConfigError(f"{tokenizer_flag} {tokenizer}: not a tokenizer folder (expected one of "
                          f"{', '.join(TOKENIZER_FILES)})")
    return encoder, tokenizer, config


class TextEncoder:
    """A loaded encoder + tokenizer: `encode(prompts, max_len) -> (embeddings float32 [B, L, D], lengths int64 [B])`."""

    def __init__(self, model: torch.nn.Module, tokenizer, device: torch.device, dtype: torch.dtype):
        self.model, self.tokenizer, self.device, self.dtype = model, tokenizer, device, dtype
        self.dim = int(model.config.d_model)

    @classmethod
    def from_folder(cls, path: str, tokenizer: Optional[str] = None, device="cpu",
                    dtype: torch.dtype = torch.float32, flag: str = "--text-encoder",
                    tokenizer_flag: str = "--tokenizer") -> "TextEncoder":
        path, tokenizer, config = resolve_folders(path, tokenizer, flag, tokenizer_flag)
        name = ENCODERS[config["model_type"]]
        import transformers  # deferred: heavy, and only needed once weights load
        try:
            tok = transformers.AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{tokenizer_flag} {tokenizer}: cannot load the tokenizer ({e})") from e
        try:
            model = getattr(transformers, name).from_pretrained(path, dtype=dtype, local_files_only=True)
        except (OSError, ValueError, RuntimeError) as e:
            raise ConfigError(f"{flag} {path}: cannot load {name} weights ({e})") from e
        device = torch.device(device)
        return cls(model.to(device).eval().requires_grad_(False), tok, device, dtype)

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], max_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Steps 1-5 of the module docstring for a batch of prompts."""
        texts: List[str] = [clean_prompt(p) for p in prompts]
        tokens = self.tokenizer(texts, padding="max_length", max_length=max_len, truncation=True,
                                add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        ids, mask = tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)
        lengths = mask.gt(0).sum(dim=1).long()
        hidden = self.model(ids, mask).last_hidden_state.float()
        keep = torch.arange(hidden.shape[1], device=hidden.device)[None, :] < lengths[:, None]
        return torch.where(keep[..., None], hidden, torch.zeros((), device=hidden.device)), lengths.cpu()
