"""The DiT family: a tensor-parallel DiT with adaLN-Zero blocks on megatron-core linears.

Shapes: x [B, C, H, W] -> tokens [B, S, hidden] with S = (H/p)^2; sigma [B]; cond labels [B] int64 or embeddings
[B, D] / [B, L, D]. Output: velocity v [B, C, H, W]. The spec's parameterisation adapter
(`models/dit/parameterization.py`) says what the network sees and predicts: ours (timestep 1000 sigma, velocity), or a
SiT / DDPM-epsilon teacher imported from its checkpoint (`models/dit/checkpoints.py`), whose network sees its own
path and timestep and whose prediction the adapter turns into our velocity.

Block (NeMo's DiTLayerWithAdaLN pattern), c = t_emb + cond_emb:
    shift1, scale1, gate1, shift2, scale2, gate2 = adaLN(silu(c))        # column, gathered
    h = h + gate1 * proj(attn(qkv(LN(h) * (1 + scale1) + shift1)))    # qkv column, proj row
    h = h + gate2 * fc2(gelu(fc1(LN(h) * (1 + scale2) + shift2))))    # fc1 column, fc2 row
LN + modulation is the fused `dmd2_kernels.adaln_modulate` (Triton on CUDA, fwd + bwd). The qkv
projection's output is laid out per head as [heads, 3, d], so its column split gives each TP rank
whole heads. adaLN and the final projection start at zero (adaLN-Zero).
`--recompute-granularity selective | full` recomputes each block in backward, selective keeping its attention output
(`models/recompute.py`: torch's non-reentrant checkpoint on every device; CPU tests run the GPU's path).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import dmd2_kernels
from dmd2_mega.errors import ConfigError
from dmd2_mega.models import linears, recompute
from dmd2_mega.models.attention import attention
from dmd2_mega.models.embeddings import LabelEmbedder, TextEmbedder, TimestepEmbedder, dit_sincos_2d, sincos_2d
from dmd2_mega.models.family import BuildOptions, DataShape, FamilyModel, check_build, joined_rows
from dmd2_mega.models.dit.parameterization import build_adapter


@dataclass(frozen=True)
class DiTSpec:
    name: str
    """The `--model-size` it is registered under (named in errors)."""
    hidden_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    mlp_ratio: float = 4.0
    freq_dim: int = 256
    """Width of the sinusoidal timestep features fed to the timestep MLP."""
    # What an imported checkpoint fixes (the defaults are our own DiTs'): models/dit/checkpoints.py
    parameterization: str = "flow"
    """What the network predicts on which path: flow (ours), sit, vp-eps (models/dit/parameterization.py)."""
    beta_start: float = 1e-4
    beta_end: float = 0.02
    num_train_timesteps: int = 1000
    """vp-eps: the discrete linear-beta schedule the network was trained on."""
    pos_table: str = "ours"
    """ours (`embeddings.sincos_2d`) or dit (the official DiT / SiT table, `embeddings.dit_sincos_2d`)."""
    freq_shift: int = 0
    """1 for diffusers' DiTTransformer2DModel (`embeddings.TimestepEmbedder`)."""
    mlp_norm_eps: float = 1e-6
    """The MLP's LayerNorm eps: 1e-6 (official DiT / SiT) or diffusers' DiT's norm_eps (1e-5)."""
    in_channels: Optional[int] = None
    sample_size: Optional[int] = None
    num_classes: Optional[int] = None
    """A converted checkpoint's latent channels, side and classes: the data must match (None: any data)."""

    @property
    def head_dim(self) -> int:
        """What the attention backend is chosen for (`models/attention.choose`)."""
        return self.hidden_size // self.num_heads

    def data_shape(self) -> DataShape:
        """The shape a converted checkpoint was trained on (its load_model / sample shape without data)."""
        if None in (self.in_channels, self.sample_size, self.num_classes):
            raise ConfigError(f"--model-size {self.name} fixes no data shape; give the data")
        return DataShape(self.in_channels, self.sample_size, num_classes=self.num_classes)

    def check_data(self, shape: DataShape) -> None:
        """ConfigError when the data does not fit what a converted checkpoint was trained on."""
        want = (self.in_channels, self.sample_size, self.num_classes)
        have = (shape.in_channels, shape.spatial[0], shape.num_classes)
        if any(w is not None and w != h for w, h in zip(want, have)):
            raise ConfigError(f"--model-size {self.name} was trained on {want[0]} x {want[1]} x {want[1]} latents "
                              f"with {want[2]} classes; the data gives {have[0]} x {list(shape.spatial)} samples "
                              f"with {have[2]} classes")


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """layer_norm(x) * (1 + scale) + shift; x [B, S, H], shift/scale [B, H] (fused kernel)."""
    return dmd2_kernels.adaln_modulate(x, shift, scale, eps=eps)


class DiTBlock(nn.Module):
    def __init__(self, spec: DiTSpec, mcfg, tp_size: int, impl: str, attn_backend: str):
        super().__init__()
        h, heads = spec.hidden_size, spec.num_heads
        self.local_heads, self.head_dim = heads // tp_size, h // heads
        self.mlp_norm_eps = spec.mlp_norm_eps
        self.attn_backend = attn_backend
        xavier, zeros = nn.init.xavier_uniform_, nn.init.zeros_
        self.adaln = linears.column(h, 6 * h, mcfg, zeros, gather_output=True)
        self.qkv = linears.column(h, 3 * h, mcfg, xavier, impl)
        self.proj = linears.row(h, h, mcfg, xavier, impl)
        mlp = int(h * spec.mlp_ratio)
        self.fc1 = linears.column(h, mlp, mcfg, xavier, impl)
        self.fc2 = linears.row(mlp, h, mcfg, xavier, impl)

    def forward(self, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaln(F.silu(c)).chunk(6, dim=-1)
        b, s, _ = h.shape
        qkv = self.qkv(modulate(h, shift1, scale1)).view(b, s, self.local_heads, 3, self.head_dim)
        q, k, v = qkv.unbind(3)  # each [B, S, heads_local, d], views
        a = attention(q, k, v, self.attn_backend).reshape(b, s, -1)
        h = h + gate1[:, None] * self.proj(a)
        m = self.fc2(F.gelu(self.fc1(modulate(h, shift2, scale2, self.mlp_norm_eps)), approximate="tanh"))
        return h + gate2[:, None] * m


class DiT(FamilyModel):
    """The DiT family's model (interface: `models.family`); built by `family.DiTFamily.build` / `registry.build_model`."""

    def __init__(self, spec: DiTSpec, shape: DataShape, tp_size: int = 1, options: BuildOptions = BuildOptions()):
        super().__init__()
        check_build(spec.name, spec.num_heads, tp_size, options)
        if options.context_parallel > 1 or options.sequence_parallel:
            raise ConfigError(f"--context-parallel-size / --sequence-parallel split long token sequences and are built "
                              f"for the Wan family; --model-size {spec.name} (DiT) runs with TP and DP only")
        if len(shape.spatial) != 2 or shape.spatial[0] != shape.spatial[1]:
            raise ConfigError(f"--model-size {spec.name} (DiT) takes square images [C, H, H]; the data's samples "
                              f"are {list(shape.sample_shape)}")
        if shape.spatial[0] % spec.patch_size:
            raise ConfigError(f"image size {shape.spatial[0]} is not a multiple of the patch size "
                              f"{spec.patch_size} of --model-size {spec.name}")
        if (shape.num_classes is None) == (shape.cond_shape is None):
            raise ValueError("exactly one of num_classes (labels) or cond_shape (embeddings) must be given")
        spec.check_data(shape)
        in_channels, image_size, num_classes, cond_shape = (shape.in_channels, shape.spatial[0], shape.num_classes,
                                                            shape.cond_shape)
        self.spec, self.options, self.shape = spec, options, shape
        self.num_feature_layers, self.feature_dim = spec.num_layers, spec.hidden_size
        self.feature_grid = (image_size // spec.patch_size,) * 2
        self.in_channels, self.image_size, self.patch = in_channels, image_size, spec.patch_size
        self.num_classes, self.cond_shape = num_classes, cond_shape
        h, p = spec.hidden_size, spec.patch_size
        mcfg = linears.megatron_config(h, spec.num_layers, spec.num_heads, tp_size)
        self.x_embed = nn.Linear(in_channels * p * p, h)
        nn.init.xavier_uniform_(self.x_embed.weight)
        nn.init.zeros_(self.x_embed.bias)
        pos = {"ours": sincos_2d, "dit": dit_sincos_2d}[spec.pos_table]
        self.register_buffer("pos", pos(image_size // p, h), persistent=False)
        self.adapter = build_adapter(spec.parameterization, spec.beta_start, spec.beta_end, spec.num_train_timesteps)
        self.t_embed = TimestepEmbedder(h, spec.freq_dim, spec.freq_shift)
        self.y_embed = LabelEmbedder(num_classes, h) if num_classes is not None else TextEmbedder(cond_shape, h)
        if cond_shape is not None:  # text: the negative-prompt embedding (`set_negative`), zeros until set
            self.register_buffer("negative", torch.zeros(cond_shape), persistent=False)
        self.blocks = nn.ModuleList(DiTBlock(spec, mcfg, tp_size, options.transformer_impl, options.attention_backend)
                                    for _ in range(spec.num_layers))
        self.final_adaln = linears.column(h, 2 * h, mcfg, nn.init.zeros_, gather_output=True)
        self.final = nn.Linear(h, p * p * in_channels)
        nn.init.zeros_(self.final.weight)
        nn.init.zeros_(self.final.bias)

    def null_cond(self, n: int, device) -> torch.Tensor:
        if self.num_classes is not None:
            return torch.full((n,), self.num_classes, dtype=torch.long, device=device)
        return self.negative.to(device=device, dtype=torch.float32).expand(n, *self.cond_shape)

    def _embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: torch.Tensor):
        """(tokens h [B, S, hidden], conditioning c [B, hidden]) of the network's own input and timestep."""
        b, ch, hh, _ = x.shape
        p, g = self.patch, hh // self.patch
        x = x.to(self.x_embed.weight.dtype)  # bf16 models take fp32 inputs
        tokens = x.reshape(b, ch, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(b, g * g, ch * p * p)
        return self.x_embed(tokens) + self.pos.to(tokens.dtype), self.t_embed(timestep) + self.y_embed(cond)

    def _block(self, i: int, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        blk = self.blocks[i]
        # `models/recompute.py`; nothing to recompute without grad (the rollout)
        how = self.options.recompute if self.training and torch.is_grad_enabled() else "none"
        return recompute.run(how, blk, h, c, compile_=self.options.compile)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < len(self.blocks):
            raise IndexError(f"feature layer {layer} is outside the DiT's blocks [0, {len(self.blocks) - 1}]")

    def features(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor, layer: int) -> torch.Tensor:
        """Block `layer`'s output as its token grid [B, hidden, g, g]; the blocks after it are not run."""
        self._check_layer(layer)
        h, c = self.region("_embed")(*self.adapter.inputs(x, sigma), cond)
        for i in range(layer + 1):
            h = self._block(i, h, c)
        return token_grid(h)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Our velocity v [B, C, H, W] at (x_sigma, sigma): the network seen through its parameterisation adapter."""
        return self.adapter.velocity(x, sigma, self.network(*self.adapter.inputs(x, sigma), cond))

    def forward_features(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor, layer: int):
        """(v, block `layer`'s output as its token grid) from one forward."""
        out, feats = self._network(*self.adapter.inputs(x, sigma), cond, layer)
        return self.adapter.velocity(x, sigma, out), feats

    def forward_features_and(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor, layer: int, extra):
        """`FamilyModel.forward_features_and` in one pass: x and the extra rows are one batch up to block `layer`,
        then x's rows alone."""
        n = x.shape[0]
        xs, sigmas, conds = joined_rows((x, sigma, cond), extra)
        out, feats = self._network(*self.adapter.inputs(xs, sigmas), conds, layer, keep=n)
        return self.adapter.velocity(x, sigma, out), feats[:n], feats[n:]

    def network(self, x: torch.Tensor, timestep: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """The network's own prediction [B, C, H, W] at its own input and timestep (for an imported checkpoint what
        the official code returns: SiT's velocity, DiT's epsilon; ours: v at timestep 1000 sigma)."""
        return self._network(x, timestep, cond)[0]

    def _network(self, x: torch.Tensor, timestep: torch.Tensor, cond: torch.Tensor, tap: Optional[int] = None,
                 keep: Optional[int] = None):
        """(the network's prediction, block `tap`'s output as its token grid [B, hidden, g, g] or None); with `keep`,
        only the first `keep` rows go on after block `tap` (the prediction is theirs, the features every row's)."""
        if tap is not None:
            self._check_layer(tap)
        ch, hh = x.shape[1], x.shape[2]
        h, c = self.region("_embed")(x, timestep, cond)
        feats = None
        for i in range(len(self.blocks)):
            h = self._block(i, h, c)
            if i == tap:
                feats = token_grid(h)
                if keep is not None:
                    h, c = h[:keep], c[:keep]
        return self.region("_final")(h, c, ch, hh), feats

    def _final(self, h: torch.Tensor, c: torch.Tensor, ch: int, hh: int) -> torch.Tensor:
        """Tokens [B, S, hidden] -> the prediction [B, ch, hh, hh] (the final adaLN, linear and unpatchify)."""
        b, p, g = h.shape[0], self.patch, hh // self.patch
        shift, scale = self.final_adaln(F.silu(c)).chunk(2, dim=-1)
        out = self.final(modulate(h, shift, scale))
        return out.reshape(b, g, g, ch, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, ch, hh, hh)


def token_grid(h: torch.Tensor) -> torch.Tensor:
    """Tokens [B, g * g, hidden] (row-major patches) -> the grid [B, hidden, g, g] (`FamilyModel.features`)."""
    b, n, d = h.shape
    g = math.isqrt(n)
    return h.transpose(1, 2).reshape(b, d, g, g)
