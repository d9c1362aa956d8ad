"""The Wan family: the Wan 2.1 / 2.2 text-to-video transformer on megatron-core tensor-parallel linears.

The reference is diffusers' `WanTransformer3DModel`; weights convert both ways exactly
(`models/wan/diffusers.py`). Shapes: x [B, C, T, H, W] -> tokens [B, S, D] with S = (T/pt)(H/ph)(W/pw)
(frame-major, then row, then column); sigma [B] (model timestep t = 1000 sigma); cond = text embeddings
[B, L, text_dim] (per token, no pooling). Output: velocity v [B, C, T, H, W] (Wan predicts eps - x0 on
x_s = (1 - s) x0 + s eps: DESIGN section 1's convention, no adapter).

    tokens  = patch_embedding(patches of x)                       # a Conv3d with kernel = stride = patch, as a linear
    temb    = time_embedder(sincos(1000 sigma))                   # linear, SiLU, linear              [B, D]
    mod     = time_proj(silu(temb))  -> [B, 6, D]                 # column-parallel, gathered
    ctx     = text_embedder(cond)                                 # linear, tanh-GELU, linear        [B, L, D]
    block:  shift1, scale1, gate1, shift2, scale2, gate2 = scale_shift_table [1, 6, D] + mod (fp32)
            h = h + gate1 * to_out(attn(qk_norm_rope(to_q(n)), qk_norm_rope(to_k(n)), to_v(n))),
                n = LN(h) (1 + scale1) + shift1                   # fp32 LayerNorm, no affine
            h = h + to_out(attn(qk_norm(to_q(LN_affine(h))), qk_norm(to_k(ctx)), to_v(ctx)))
            h = h + gate2 * fc2(gelu_tanh(fc1(LN(h) (1 + scale2) + shift2)))
    out     = proj_out(LN(h) (1 + scale) + shift), shift, scale = scale_shift_table [1, 2, D] + temb
            -> unpatchify (channel-last per patch: [pt, ph, pw, C])

Tensor parallelism: heads are split over TP (to_q / to_k / to_v / fc1 column, to_out / fc2 row). Wan's
q / k RMSNorm spans ALL heads (the full hidden size), so under TP each rank holds its slice of the norm
weight and the row's mean square is all-reduced over the TP group inside `dmd2_kernels.qk_norm_rope` (forward:
sum of x^2; backward: sum of du * u). The embeddings, the output projection and the modulation tables are
replicated; time_proj (D -> 6D) is column-parallel and gathered. LayerNorm + modulation is the fused
`dmd2_kernels.adaln_modulate`; RMSNorm + 3-D rotary (`models/rope.py`) is the fused `dmd2_kernels.qk_norm_rope`.

Context / sequence parallelism (`models/token_parallel.py`): the patches are split over the CP ranks (and the TP
ranks under --sequence-parallel) before the patch embedding, self-attention exchanges sequence for heads with an
all-to-all, cross-attention reads the whole text, and the output projection's tokens are gathered before the
unpatchify, so every rank returns the whole v. Replicated parameters used only on a rank's tokens are tagged
for the TP sum of their gradients under SP.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

import dmd2_kernels
from dmd2_mega.errors import ConfigError
from dmd2_mega.models import linears, recompute
from dmd2_mega.models.attention import attention
from dmd2_mega.models.config_keys import Key, count, positive, read_keys
from dmd2_mega.models.embeddings import sincos_1d
from dmd2_mega.models.family import BuildOptions, DataShape, FamilyModel, check_build, joined_rows
from dmd2_mega.models.rope import rope_tables
from dmd2_mega.models.token_parallel import TokenSplit
from dmd2_mega.models.wan.image import (CLIP_LEN, MASK_CHANNELS, CondParts, ImageEmbedder, chunk_frames, concat_mask,
                                        fp32_layer_norm)
from dmd2_mega.distributed.parallel import mark_sequence_parallel

DIFFUSERS_CLASS = "WanTransformer3DModel"


_CONFIG_KEYS = {  # what from_config reads of a WanTransformer3DModel config.json, typed (`models/config_keys.py`)
    "num_attention_heads": count(), "attention_head_dim": count(), "num_layers": count(), "ffn_dim": count(),
    "in_channels": count(), "out_channels": count(None, nullable=True), "text_dim": count(), "freq_dim": count(),
    "patch_size": Key(int, low=1, length=3), "cross_attn_norm": Key(bool, True), "eps": positive(1e-6),
    "rope_max_seq_len": count(1024), "image_dim": count(None, nullable=True),
    "added_kv_proj_dim": count(None, nullable=True)}

TEXT_LEN = 512
"""Wan's text length (UMT5 tokens, zero-padded): the negative buffer's length when no data gives one."""


@dataclass(frozen=True)
class WanSpec:
    """A Wan transformer's sizes: the fields of diffusers' `WanTransformer3DModel` config.json that we support."""

    name: str
    """The --model-size name, or the folder its config.json came from (named in errors)."""
    num_heads: int
    head_dim: int
    num_layers: int
    ffn_dim: int
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    patch_size: tuple = (1, 2, 2)
    cross_attn_norm: bool = True
    eps: float = 1e-6
    rope_max_seq_len: int = 1024
    image_dim: Optional[int] = None
    """Wan 2.1 I2V: the CLIP image embeddings' width, read as extra cross-attention keys / values (`image.py`)."""
    boundary_ratio: Optional[float] = None
    """Two-expert Wan 2.2 A14B (`models/wan/experts.py`): the high-noise expert predicts where the timestep is
    >= boundary_ratio * 1000, the low-noise one below; None for one model."""

    @property
    def experts(self) -> tuple:
        """The pipeline subfolders of the experts: ('transformer', 'transformer_2'), or () for one model."""
        return ("transformer", "transformer_2") if self.boundary_ratio is not None else ()

    @property
    def hidden_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def mask_channels(self) -> int:
        """The concat I2V form's mask channels (in_channels = 2 out_channels + mask); 0 for text-to-video."""
        return self.in_channels - 2 * self.out_channels if self.in_channels != self.out_channels else 0

    def data_shape(self) -> DataShape:
        """The shape to build a converted Wan with when no data gives one (`pretrained.load_model`, the meta model
        of a conversion): one latent frame of one patch, Wan's TEXT_LEN tokens of text (an I2V Wan: and CLIP_LEN image
        tokens, the image latent)."""
        if not self.mask_channels:
            return DataShape(self.in_channels, self.patch_size, cond_shape=(TEXT_LEN, self.text_dim))
        clip = (("clip", (CLIP_LEN, self.image_dim)),) if self.image_dim else ()
        return DataShape(self.out_channels, self.patch_size, cond_parts=(
            ("text", (TEXT_LEN, self.text_dim)), *clip, ("image", (self.out_channels, *self.patch_size))))

    def __post_init__(self):
        if self.head_dim % 2 or self.head_dim < 6:
            raise ConfigError(f"{self.name}: attention_head_dim {self.head_dim} must be even and >= 6 (3-D rotary)")
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise ConfigError(f"{self.name}: patch_size must be 3 positive ints, got {self.patch_size}")
        if self.image_dim is not None and not self.mask_channels:
            raise ConfigError(f"{self.name}: image_dim {self.image_dim} (CLIP image embeddings) comes with the image-"
                              f"to-video channels in_channels = 2 out_channels + {MASK_CHANNELS}; got in_channels "
                              f"{self.in_channels}, out_channels {self.out_channels}")
        if self.boundary_ratio is not None and not 0 < self.boundary_ratio < 1:
            raise ConfigError(f"{self.name}: boundary_ratio must lie in (0, 1), got {self.boundary_ratio}")
        if self.out_channels != self.in_channels and self.in_channels != 2 * self.out_channels + MASK_CHANNELS:
            raise ConfigError(f"{self.name}: in_channels {self.in_channels} with out_channels {self.out_channels}: a "
                              f"velocity model reads the channels it predicts (text-to-video, in = out) or, as an "
                              f"image-to-video Wan, those, a {MASK_CHANNELS}-channel mask and the image's latent "
                              f"(in = 2 out + {MASK_CHANNELS})")

    def diffusers_config(self) -> dict:
        """The config.json of the equivalent `WanTransformer3DModel`."""
        return {"_class_name": DIFFUSERS_CLASS, "patch_size": list(self.patch_size),
                "num_attention_heads": self.num_heads, "attention_head_dim": self.head_dim,
                "in_channels": self.in_channels, "out_channels": self.out_channels, "text_dim": self.text_dim,
                "freq_dim": self.freq_dim, "ffn_dim": self.ffn_dim, "num_layers": self.num_layers,
                "cross_attn_norm": self.cross_attn_norm, "qk_norm": "rms_norm_across_heads", "eps": self.eps,
                "image_dim": self.image_dim, "added_kv_proj_dim": self.hidden_size if self.image_dim else None,
                "rope_max_seq_len": self.rope_max_seq_len,
                "pos_embed_seq_len": None}

    @classmethod
    def from_config(cls, config: dict, name: str) -> "WanSpec":
        """From a diffusers config.json dict; a ConfigError naming `name` for anything we do not build."""
        cls_name = config.get("_class_name")
        if cls_name != DIFFUSERS_CLASS:
            raise ConfigError(f"{name}: config.json describes a {cls_name}, not a {DIFFUSERS_CLASS}")
        if config.get("pos_embed_seq_len") is not None:
            raise ConfigError(f"{name}: pos_embed_seq_len={config['pos_embed_seq_len']} (Wan 2.1 FLF2V, first and "
                              f"last frame) is not supported; the Wan family builds text- and image-to-video")
        if config.get("qk_norm", "rms_norm_across_heads") != "rms_norm_across_heads":
            raise ConfigError(f"{name}: qk_norm={config['qk_norm']!r} is not supported (rms_norm_across_heads only)")
        c = read_keys(config, _CONFIG_KEYS, name, what=f"a {DIFFUSERS_CLASS}")
        hidden = c["num_attention_heads"] * c["attention_head_dim"]
        if (c["image_dim"] is None) != (c["added_kv_proj_dim"] is None) or c["added_kv_proj_dim"] not in (None, hidden):
            raise ConfigError(f"{name}: image_dim={c['image_dim']} with added_kv_proj_dim={c['added_kv_proj_dim']}; "
                              f"Wan 2.1 I2V sets both, added_kv_proj_dim the hidden size {hidden}")
        return cls(name=name, num_heads=c["num_attention_heads"], head_dim=c["attention_head_dim"],
                   num_layers=c["num_layers"], ffn_dim=c["ffn_dim"], in_channels=c["in_channels"],
                   out_channels=c["out_channels"] or c["in_channels"], text_dim=c["text_dim"], freq_dim=c["freq_dim"],
                   patch_size=c["patch_size"], cross_attn_norm=c["cross_attn_norm"], eps=c["eps"],
                   rope_max_seq_len=c["rope_max_seq_len"], image_dim=c["image_dim"])


def _tp_group(tp_size: int):
    return mpu.get_tensor_model_parallel_group() if tp_size > 1 else None


class QKNorm(nn.Module):
    """RMSNorm across all heads (+ optional rotary): the local slice [HL] of the full-width weight; the mean
    square is reduced over the TP group (`dmd2_kernels.qk_norm_rope`)."""

    def __init__(self, width_local: int, head_dim: int, eps: float, tp_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width_local))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)  # split like the heads (as megatron's linears)
        self.head_dim, self.eps, self.tp_size = head_dim, eps, tp_size

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        cos, sin = rope if rope is not None else (None, None)
        return dmd2_kernels.qk_norm_rope(x, self.weight, cos, sin, self.head_dim, self.eps,
                                         group=_tp_group(self.tp_size))


class WanAttention(nn.Module):
    """Self- (kv from the tokens, rotary) or cross-attention (kv from the text, no rotary) over local heads.
    Under CP / SP the tokens are this rank's share (`models/token_parallel.py`)."""

    def __init__(self, spec: WanSpec, mcfg, tp_size: int, impl: str, backend: str, image: bool = False):
        super().__init__()
        d = spec.hidden_size
        self.local_heads, self.head_dim, self.backend = spec.num_heads // tp_size, spec.head_dim, backend
        xavier = nn.init.xavier_uniform_
        self.to_q = linears.column(d, d, mcfg, xavier, impl)
        self.to_k = linears.column(d, d, mcfg, xavier, impl)
        self.to_v = linears.column(d, d, mcfg, xavier, impl)
        self.to_out = linears.row(d, d, mcfg, xavier, impl)
        width = d // tp_size
        self.norm_q = QKNorm(width, spec.head_dim, spec.eps, tp_size)
        self.norm_k = QKNorm(width, spec.head_dim, spec.eps, tp_size)
        if image:  # Wan 2.1 I2V's cross-attention: keys / values of the image tokens too, split over TP like the text's
            self.add_k_proj = linears.column(d, d, mcfg, xavier, impl)
            self.add_v_proj = linears.column(d, d, mcfg, xavier, impl)
            self.norm_added_k = QKNorm(width, spec.head_dim, spec.eps, tp_size)
        self.image = image

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (self.local_heads, self.head_dim))  # [B, S, heads_local, d]

    def text_kv(self, ctx: tuple) -> tuple:
        """Cross-attention's k, v [B, L, heads_local, d] of the text, then (an I2V Wan) those of the image tokens,
        from ctx = (text [B, L, D], image [B, Li, D] or None): megatron's column linears (their backward all-reduces
        the context's gradient over TP)."""
        text, image = ctx
        kv = (self._heads(self.norm_k(self.to_k(text))), self._heads(self.to_v(text)))
        if self.image:
            kv += (self._heads(self.norm_added_k(self.add_k_proj(image))), self._heads(self.add_v_proj(image)))
        return kv

    def forward(self, x: torch.Tensor, ctx: Optional[tuple], split: TokenSplit, rope=None,
                mixer=None) -> torch.Tensor:
        """x [B, local tokens, D]; ctx None for self-attention, else (text [B, L, D], image tokens [B, Li, D] or None),
        whole on every rank.
        mixer: None (every token sees every token), or a causal model's per-layer attention (`models/wan/causal.py`:
        `self_attention(q, k, v, backend)` on [B, S, heads, d], `text_kv(compute)`), which may cache k / v."""
        if ctx is None:  # every token for this rank's heads (Ulysses under CP), the padding dropped
            q, k, v = split.sp_linears(x, self.to_q, self.to_k, self.to_v)  # [B, CP chunk, D / TP] each
            q, k = self.norm_q(q, rope), self.norm_k(k, rope)
            q, k, v = (split.attention_heads(self._heads(t)) for t in (q, k, v))
            a = mixer.self_attention(q, k, v, self.backend) if mixer is not None else attention(q, k, v, self.backend)
            return self._out(split.attention_tokens(a).flatten(2), split)
        q = self._heads(self.norm_q(split.sp_linears(x, self.to_q)[0]))
        kv = self.text_kv(ctx) if mixer is None else mixer.text_kv(lambda: self.text_kv(ctx))
        a = attention(q, kv[0], kv[1], self.backend)
        if self.image:  # the image tokens' attention adds to the text's (diffusers' WanAttnProcessor)
            a = a + attention(q, kv[2], kv[3], self.backend)
        return self._out(a.flatten(2), split)

    def _out(self, a: torch.Tensor, split: TokenSplit) -> torch.Tensor:
        if split.sp > 1:
            return split.sp_reduce_scatter(self.to_out.matmul(a)) + self.to_out.bias
        return self.to_out(a)


class WanBlock(nn.Module):
    def __init__(self, spec: WanSpec, mcfg, tp_size: int, impl: str, backend: str):
        super().__init__()
        d = spec.hidden_size
        self.eps = spec.eps
        self.attn1 = WanAttention(spec, mcfg, tp_size, impl, backend)
        self.attn2 = WanAttention(spec, mcfg, tp_size, impl, backend, image=spec.image_dim is not None)
        self.norm2 = nn.LayerNorm(d, eps=spec.eps) if spec.cross_attn_norm else None
        xavier = nn.init.xavier_uniform_
        self.fc1 = linears.column(d, spec.ffn_dim, mcfg, xavier, impl)
        self.fc2 = linears.row(spec.ffn_dim, d, mcfg, xavier, impl)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, d) / d ** 0.5)

    def sequence_parallel_params(self) -> list:
        """Replicated parameters used only on this rank's tokens (`parallel.mark_sequence_parallel`)."""
        norm = list(self.norm2.parameters()) if self.norm2 is not None else []
        return [self.scale_shift_table, self.attn1.to_out.bias, self.attn2.to_out.bias, self.fc2.bias, *norm]

    def forward(self, h: torch.Tensor, ctx: torch.Tensor, mod: torch.Tensor, rope, split: TokenSplit,
                mixer=None) -> torch.Tensor:
        """mod [B, 6, D] per sample, or [B, R, 6, D] per row of tokens (`modulate`); mixer: `WanAttention`."""
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.scale_shift_table + mod.float()).unbind(-2)
        n = modulate(h, shift1, scale1, self.eps)
        h = (h.float() + gated(self.attn1(n, None, split, rope, mixer), gate1)).type_as(h)
        n = h if self.norm2 is None else fp32_layer_norm(self.norm2, h)
        h = h + self.attn2(n, ctx, split, mixer=mixer)
        n = modulate(h, shift2, scale2, self.eps)
        if split.sp > 1:  # MLP on the whole CP chunk of this rank's FFN columns; each rank keeps its tokens
            f = F.gelu(split.sp_linears(n, self.fc1)[0], approximate="tanh")
            m = split.sp_reduce_scatter(self.fc2.matmul(f)) + self.fc2.bias
        else:
            m = self.fc2(F.gelu(self.fc1(n), approximate="tanh"))
        return (h.float() + gated(m.float(), gate2)).type_as(h)


def modulate(h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """LN(h) (1 + scale) + shift of tokens h [B, L, D] (`dmd2_kernels.adaln_modulate`): shift / scale [B, D] per sample,
    or [B, R, D] per row of L / R consecutive tokens (a causal model's frames), the same fused kernel on
    [B R, L / R, D]."""
    if shift.dim() == 2:
        return dmd2_kernels.adaln_modulate(h, shift, scale, eps=eps)
    b, r, d = shift.shape
    out = dmd2_kernels.adaln_modulate(h.reshape(b * r, -1, d), shift.reshape(b * r, d), scale.reshape(b * r, d),
                                      eps=eps)
    return out.view(h.shape)


def gated(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [B, L, D] times gate [B, D] per sample, or [B, R, D] per row of L / R consecutive tokens (`modulate`)."""
    if gate.dim() == 2:
        return x * gate[:, None]
    return (x.unflatten(1, (gate.shape[1], -1)) * gate[:, :, None]).flatten(1, 2)


class ConditionEmbedder(nn.Module):
    """Timestep -> (temb [B, D], mod [B, 6, D]); text [B, L, text_dim] -> ctx [B, L, D]; an I2V Wan's CLIP image
    embeddings -> image tokens [B, Li, D] (`image.ImageEmbedder`). Names follow diffusers'."""

    def __init__(self, spec: WanSpec, mcfg):
        super().__init__()
        d = spec.hidden_size
        self.freq_dim = spec.freq_dim
        self.time_embedder = nn.Sequential(nn.Linear(spec.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_proj = linears.column(d, 6 * d, mcfg, nn.init.xavier_uniform_, gather_output=True)
        self.text_embedder = nn.Sequential(nn.Linear(spec.text_dim, d), nn.GELU(approximate="tanh"), nn.Linear(d, d))
        for lin in (*self.time_embedder[::2], *self.text_embedder[::2]):
            nn.init.xavier_uniform_(lin.weight)
            nn.init.zeros_(lin.bias)
        self.image_embedder = ImageEmbedder(spec.image_dim, d) if spec.image_dim is not None else None

    def time(self, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(temb [B, D], mod [B, 6, D]) of sigma [B]."""
        w = self.time_embedder[0].weight
        temb = self.time_embedder(sincos_1d(sigma * 1000.0, self.freq_dim).to(w.dtype))
        return temb, self.time_proj(F.silu(temb)).unflatten(1, (6, -1))

    def text(self, cond: torch.Tensor) -> torch.Tensor:
        """ctx [B, L, D] of the text embeddings cond [B, L, text_dim]."""
        return self.text_embedder(cond.to(self.text_embedder[0].weight.dtype))

    def image(self, clip: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Image tokens [B, Li, D] of CLIP embeddings [B, Li, image_dim]; None for a model without them."""
        return self.image_embedder(clip) if self.image_embedder is not None else None

    def forward(self, sigma: torch.Tensor, cond: torch.Tensor):
        return *self.time(sigma), self.text(cond)


class NegativePrompt:
    """What a Wan's condition gives its samplers (one model or two experts): CFG's negative from the `negative`
    buffer (the negative prompt's text embedding) and `parts` (an I2V condition's layout, or None); the given
    first frame of the `image_form` "first-frame"."""

    negative: torch.Tensor
    parts: Optional[CondParts]
    image_form: Optional[str]

    def null_cond(self, n: int, device) -> torch.Tensor:
        if self.parts is not None:
            raise ValueError(f"{self.spec.name} reads an image with its text: its negative condition is each "
                             f"sample's own (negative_for(cond))")
        return self.negative.to(device=device, dtype=torch.float32).expand(n, *self.negative.shape)

    def negative_for(self, cond: torch.Tensor) -> torch.Tensor:
        """CFG's negative of cond [B, ...]: the negative prompt; an I2V sample keeps its image (`image.py`)."""
        if self.parts is None:
            return self.null_cond(cond.shape[0], cond.device)
        return self.parts.with_text(cond, self.negative)

    def pin_given(self, x0: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """The first-frame I2V form (TI2V): x0's first latent frame is the given image's, which the model read in
        place of x's at timestep 0 (the pipeline's expand_timesteps); any other form returns x0."""
        if self.parts is None or self.image_form != "first-frame":
            return x0
        image = self.parts.unpack(cond, (self.parts.image[0], 1, *x0.shape[3:]))[2]
        return torch.cat([image.to(x0.dtype), x0[:, :, 1:]], dim=2)


class Wan(NegativePrompt, FamilyModel):
    """The Wan family's model (module docstring); built by `family.WanFamily.build` / `registry.build_model`."""

    def __init__(self, spec: WanSpec, shape: DataShape, tp_size: int = 1, options: BuildOptions = BuildOptions()):
        super().__init__()
        check_build(spec.name, spec.num_heads, tp_size, options)
        check_shape(spec, shape, tp_size)
        self.spec, self.shape, self.options, self.tp_size = spec, shape, options, tp_size
        self.num_feature_layers, self.feature_dim = spec.num_layers, spec.hidden_size
        self.feature_grid = tuple(n // p for n, p in zip(shape.spatial, spec.patch_size))
        d, patch = spec.hidden_size, spec.patch_size
        mcfg = linears.megatron_config(d, spec.num_layers, spec.num_heads, tp_size)
        self.patch_embedding = nn.Linear(spec.in_channels * math.prod(patch), d)
        nn.init.xavier_uniform_(self.patch_embedding.weight)
        nn.init.zeros_(self.patch_embedding.bias)
        self.condition_embedder = ConditionEmbedder(spec, mcfg)
        impl, backend = options.transformer_impl, options.attention_backend
        self.blocks = nn.ModuleList(WanBlock(spec, mcfg, tp_size, impl, backend) for _ in range(spec.num_layers))
        self.proj_out = nn.Linear(d, spec.out_channels * math.prod(patch))
        nn.init.zeros_(self.proj_out.weight)
        nn.init.zeros_(self.proj_out.bias)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, d) / d ** 0.5)
        # an I2V Wan's condition: text, CLIP embedding and image latent in one flat tensor (`image.CondParts`)
        self.parts = CondParts.from_parts(shape.cond_parts, spec.name) if shape.cond_parts else None
        self.image_form = image_form(spec, shape)
        # CFG's negative branch: the negative-prompt embedding stored with the data (`set_negative`), else zeros
        self.register_buffer("negative", torch.zeros(self.parts.text if self.parts else shape.cond_shape),
                             persistent=False)
        mark_sequence_parallel([*self.patch_embedding.parameters(), *self.proj_out.parameters(), self.scale_shift_table,
                                *(p for blk in self.blocks for p in blk.sequence_parallel_params())],
                               options.sequence_parallel)

    def _grid(self, x: torch.Tensor) -> tuple[int, int, int]:
        if x.dim() != 5:
            raise ValueError(f"Wan takes latents [B, C, T, H, W], got shape {tuple(x.shape)}")
        return tuple(n // p for n, p in zip(x.shape[2:], self.spec.patch_size))

    def _embed(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor, first_frame: int = 0):
        """(this rank's tokens [B, local, D], ctx (text [B, L, D], image tokens [B, Li, D] or None), temb, mod
        (`_conditions`), rope (cos, sin) of this CP chunk [chunk, d/2], split): the tokens are split over CP (and TP
        under SP) before the patch embedding.
        first_frame: the rotary frame index of x's first frame (a streamed chunk's place in its video)."""
        (f, hh, ww), (pt, ph, pw) = self._grid(x), self.spec.patch_size
        split = TokenSplit.current(f * hh * ww, self.options.context_parallel, self.options.sequence_parallel)
        x, text, image_tokens = self._read_image(x.to(self.patch_embedding.weight.dtype), cond, first_frame)
        b, c = x.shape[:2]
        patches = x.reshape(b, c, f, pt, hh, ph, ww, pw).permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, f * hh * ww, -1)
        cos, sin = rope_tables((f, hh, ww), self.spec.head_dim, device=x.device, first_frame=first_frame)
        temb, mod, ctx = self._conditions(sigma, text, f)
        ctx = (ctx, image_tokens)
        temb, mod = split.enter_sp(temb), split.enter_sp(mod)  # replicated over TP: enter SP before any split
        if temb.dim() == 3 and (split.cp > 1 or split.sp > 1):  # per frame: this rank's tokens read their frame's
            rows = split.local_index(x.device) // (hh * ww)
            temb, mod = temb[:, rows], mod[:, rows]
        tokens = self.patch_embedding(split.shard(patches))
        return tokens, ctx, temb, mod, (split.cp_rows(cos), split.cp_rows(sin)), split

    def _read_image(self, x: torch.Tensor, cond: torch.Tensor, first_frame: int = 0) -> tuple:
        """(the model's input latents, text [B, L, text_dim], image tokens [B, Li, D] or None) of x [B, C, T, H, W] and
        cond: a text-to-video Wan reads x and cond as they are; an I2V Wan unpacks cond (`image.py`): the concat form
        appends [mask, image latent] to x's channels (frames first_frame .. of the clip's: a streamed chunk's,
        `image.chunk_frames`), the first-frame form puts the image in x's first frame."""
        if self.parts is None:
            return x, cond, None
        concat = self.image_form == "concat"
        text, clip, image = self.parts.unpack(cond, (self.parts.image[0], None if concat else 1, *x.shape[3:]))
        image = image.to(x.dtype)
        if concat:
            image = chunk_frames(image, first_frame, x.shape[2])
            x = torch.cat([x, concat_mask(image, self.spec.mask_channels, first_frame), image], dim=1)
        else:
            x = torch.cat([image, x[:, :, image.shape[2]:]], dim=2)
        return x, text, self.condition_embedder.image(clip)

    def _conditions(self, sigma: torch.Tensor, text: torch.Tensor, frames: int):
        """(temb, mod, ctx): temb [B, D] and mod [B, 6, D] per sample, or per frame [B, F, D] and [B, F, 6, D] (a
        causal model's levels per chunk, the first-frame I2V form's clean first frame: `modulate` runs rows of
        tokens); ctx [B, L, D]."""
        temb, mod, ctx = self.condition_embedder(sigma, text)
        if self.image_form == "first-frame":  # the image's frame at timestep 0, as WanImageToVideoPipeline's TI2V
            temb0, mod0 = self.condition_embedder.time(torch.zeros_like(sigma))
            temb = torch.cat([temb0[:, None], temb[:, None].expand(-1, frames - 1, -1)], 1)
            mod = torch.cat([mod0[:, None], mod[:, None].expand(-1, frames - 1, -1, -1)], 1)
        return temb, mod, ctx

    def _block(self, i: int, h, ctx, mod, rope, split, mixer=None):
        blk, mixer = self.blocks[i], mixer.layer(i) if mixer is not None else None
        if mixer is not None and not mixer.stateless:
            # a KV cache's write flag, positions and lengths change per chunk and per layer: compiled, each would be a
            # graph of its own (past torch's limit the block ran eager for every caller); the streaming pass is eager
            return blk.forward(h, ctx, mod, rope, split, mixer)
        # `models/recompute.py`; a stateful mixer (a KV cache being read and filled) is not re-run in backward: the
        # recompute would differ
        if self.options.recompute != "none" and self.training and torch.is_grad_enabled() and (
                mixer is None or mixer.stateless):
            # the context's tensors as arguments of their own: the checkpoint keeps them, as it keeps h
            return recompute.run(self.options.recompute, _run_block, blk, h, *ctx, mod, rope, split, mixer,
                                 compile_=self.options.compile)
        return blk(h, ctx, mod, rope, split, mixer)

    def _features(self, x, sigma, cond, layer: int, mixer=None) -> torch.Tensor:
        if not 0 <= layer < len(self.blocks):
            raise IndexError(f"feature layer {layer} is outside the Wan blocks [0, {len(self.blocks) - 1}]")
        h, ctx, _, mod, rope, split = self._embed(x, sigma, cond)
        for i in range(layer + 1):
            h = self._block(i, h, ctx, mod, rope, split, mixer)
        return token_grid(split, h, self._grid(x))

    def _forward(self, x, sigma, cond, mixer=None, first_frame: int = 0) -> torch.Tensor:
        return self._run(x, sigma, cond, mixer, first_frame)[0]

    def _run(self, x, sigma, cond, mixer=None, first_frame: int = 0, tap: Optional[int] = None,
             keep: Optional[int] = None):
        """(v, block `tap`'s output as its token grid [B, D, F, H, W] (whole on every rank) or None) of one forward;
        with `keep`, only the first `keep` rows go on after block `tap` (v is theirs, the features every row's)."""
        if tap is not None and not 0 <= tap < len(self.blocks):
            raise IndexError(f"feature layer {tap} is outside the Wan blocks [0, {len(self.blocks) - 1}]")
        b, c = x.shape[:2]
        (f, hh, ww), (pt, ph, pw) = self._grid(x), self.spec.patch_size
        h, ctx, temb, mod, rope, split = self._embed(x, sigma, cond, first_frame)
        feats = None
        for i in range(len(self.blocks)):
            h = self._block(i, h, ctx, mod, rope, split, mixer)
            if i == tap:
                feats = token_grid(split, h, (f, hh, ww))
                if keep is not None:  # every per-row input is batch-first
                    b, h, temb, mod = keep, h[:keep], temb[:keep], mod[:keep]
                    ctx = tuple(t if t is None else t[:keep] for t in ctx)
        shift, scale = (self.scale_shift_table + temb.float().unsqueeze(-2)).unbind(-2)
        out = split.gather(self.proj_out(modulate(h, shift, scale, self.spec.eps)))
        out = out.reshape(b, f, hh, ww, pt, ph, pw, c).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return out.reshape(b, c, f * pt, hh * ph, ww * pw), feats

    def features(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor, layer: int) -> torch.Tensor:
        return self._features(x, sigma, cond, layer)

    def forward_features(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor, layer: int):
        """(v, block `layer`'s output as its token grid) from one forward."""
        return self._run(x, sigma, cond, tap=layer)

    def forward_features_and(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor, layer: int, extra):
        """`FamilyModel.forward_features_and` in one pass (x and the extra rows one batch up to block `layer`)."""
        return self._joined(x, sigma, cond, layer, extra, None)

    def _joined(self, x, sigma, cond, layer: int, extra, mixer):
        if sigma.shape[1:] != extra[1].shape[1:]:  # per-chunk levels beside per-sample ones: two passes
            return super().forward_features_and(x, sigma, cond, layer, extra)
        n = x.shape[0]
        xs, sigmas, conds = joined_rows((x, sigma, cond), extra)
        v, feats = self._run(xs, sigmas, conds, mixer, tap=layer, keep=n)
        return v, feats[:n], feats[n:]

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """v [B, C, T, H, W]."""
        return self._forward(x, sigma, cond)


def token_grid(split: TokenSplit, h: torch.Tensor, grid: tuple) -> torch.Tensor:
    """This rank's tokens [B, local, D] -> every token as the grid [B, D, F, H, W] (`FamilyModel.features`), the same
    on every CP / SP rank: gathered (`TokenSplit.gather`, whose backward keeps this rank's slice of the gradient,
    right when every rank goes on with the same head and loss)."""
    h = split.gather(h)
    return h.transpose(1, 2).reshape(h.shape[0], h.shape[2], *grid)


def image_form(spec: WanSpec, shape: DataShape) -> Optional[str]:
    """How the model reads an image (`image.py`): "concat" (Wan 2.1 / 2.2 I2V: in_channels = 2 out + mask),
    "first-frame" (a text-to-video config given image conditions: TI2V-5B's image mode) or None (text only)."""
    if spec.mask_channels:
        return "concat"
    return "first-frame" if shape.cond_parts else None


def _check_image(spec: WanSpec, shape: DataShape) -> tuple:
    """The text shape of `shape`'s condition, after checking its image parts against the spec's form."""
    form = image_form(spec, shape)
    if form == "concat" and not shape.cond_parts:
        raise ConfigError(f"--model-size {spec.name} is an image-to-video Wan (in_channels {spec.in_channels}): the "
                          f"data must carry each clip's image latent (prepare_data.py with an I2V pipeline)")
    if form is None:
        return shape.cond_shape
    parts = CondParts.from_parts(shape.cond_parts, spec.name)
    want = ((spec.out_channels, *shape.spatial) if form == "concat" else (spec.in_channels, 1, *shape.spatial[1:]))
    if tuple(parts.image) != tuple(want):
        raise ConfigError(f"the data's image latents are {list(parts.image)}, but --model-size {spec.name} reads "
                          f"{list(want)} ({form} image-to-video) for latents {list(shape.sample_shape)}")
    if (parts.clip is not None) != (spec.image_dim is not None) or (parts.clip and parts.clip[1] != spec.image_dim):
        raise ConfigError(f"the data's CLIP image embeddings are {list(parts.clip) if parts.clip else None}, but "
                          f"--model-size {spec.name} reads "
                          f"{'[L, %d]' % spec.image_dim if spec.image_dim else 'none'} (image_dim)")
    return parts.text


def _run_block(blk: WanBlock, h, text, image, mod, rope, split, mixer):
    return blk(h, (text, image), mod, rope, split, mixer)


def check_shape(spec: WanSpec, shape: DataShape, tp_size: int) -> None:
    """ConfigError naming the flag or size for a data shape / TP size this spec cannot take (the heads:
    `family.check_build`)."""
    if spec.ffn_dim % tp_size:
        raise ConfigError(f"--tensor-model-parallel-size {tp_size} must divide ffn_dim {spec.ffn_dim} of "
                          f"--model-size {spec.name}")
    text = _check_image(spec, shape)
    if text is None or len(text) != 2:
        raise ConfigError(f"--model-size {spec.name} (Wan) takes text embeddings [L, {spec.text_dim}] per sample; "
                          f"the data has {'class labels' if text is None else list(text)}")
    if text[-1] != spec.text_dim:
        raise ConfigError(f"the data's text embeddings are {text[-1]} wide, but --model-size "
                          f"{spec.name} has text_dim {spec.text_dim}")
    if shape.in_channels != spec.out_channels:
        raise ConfigError(f"the data's latents have {shape.in_channels} channels, but --model-size {spec.name} "
                          + (f"takes {spec.out_channels} latent channels (in_channels {spec.in_channels} with the "
                             f"mask and the image latent)" if spec.mask_channels else
                             f"takes in_channels {spec.in_channels}"))
    if len(shape.spatial) != 3:
        raise ConfigError(f"--model-size {spec.name} (Wan) takes video latents [C, T, H, W]; the data's are "
                          f"{[shape.in_channels, *shape.spatial]}")
    for n, p, what in zip(shape.spatial, spec.patch_size, ("frames", "height", "width")):
        if n % p:
            raise ConfigError(f"latent {what} {n} is not a multiple of the patch size {p} of --model-size {spec.name}")
        if n // p > spec.rope_max_seq_len:
            raise ConfigError(f"latent {what} {n} gives {n // p} positions, more than rope_max_seq_len "
                              f"{spec.rope_max_seq_len} of --model-size {spec.name}")
