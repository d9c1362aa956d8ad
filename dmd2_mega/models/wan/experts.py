"""Wan 2.2 A14B: two Wan transformers of one spec, switched by the noise level (diffusers' `WanPipeline` with
`boundary_ratio`): the high-noise expert (`transformer`, here `high`) predicts where the model timestep
t = 1000 sigma is >= 1000 boundary_ratio, the low-noise expert (`transformer_2`, here `low`) below.

One model of the family interface, so one role: `forward(x, sigma, cond)` routes each sample to its expert
(`index_select` in, `index_copy` out: gradients reach only the expert that saw the sample); `features` routes
the same way; `null_cond` / `set_negative` are the experts' shared negative prompt. Parameters are named
`high.<wan name>` and `low.<wan name>`. Routing reads how many samples go each way, one host sync per call; a
call whose samples all sit on one side of the boundary runs only that expert. A trained role (student, critic)
keeps both experts resident; the time-sliced teacher wakes each expert only for its own forward
(`expert_modules`, `offload.ExpertSleeper`), so one expert at a time is on the device.
"""
from __future__ import annotations

import torch

from dmd2_mega.models.family import BuildOptions, DataShape, FamilyModel
from dmd2_mega.models.wan.model import NegativePrompt, Wan, WanSpec

EXPERTS = ("transformer", "transformer_2")
"""The pipeline subfolders of the high- and the low-noise expert."""


class WanExperts(NegativePrompt, FamilyModel):
    """Two experts (module docstring); its own copy of the negative prompt stays readable while a time-sliced
    teacher's experts sleep."""

    def __init__(self, spec: WanSpec, shape: DataShape, tp_size: int = 1, options: BuildOptions = BuildOptions()):
        super().__init__()
        if spec.boundary_ratio is None:
            raise ValueError("a two-expert Wan needs spec.boundary_ratio")
        self.spec, self.shape, self.options = spec, shape, options
        self.high = Wan(spec, shape, tp_size, options)
        self.low = Wan(spec, shape, tp_size, options)
        self.num_feature_layers, self.feature_dim = spec.num_layers, spec.hidden_size
        self.feature_grid = self.high.feature_grid
        self.boundary_t = spec.boundary_ratio * 1000.0
        self.parts, self.image_form = self.high.parts, self.high.image_form
        self.register_buffer("negative", torch.zeros_like(self.high.negative), persistent=False)

    def expert_modules(self) -> tuple:
        return (self.high, self.low)

    def transformer_blocks(self) -> list:
        return [blk for expert in self.expert_modules() for blk in expert.transformer_blocks()]

    def set_negative(self, emb: torch.Tensor) -> None:
        super().set_negative(emb)
        for expert in self.expert_modules():
            expert.set_negative(emb)

    def _route(self, fn, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor):
        """fn(expert, x, sigma, cond) per expert on its samples (a tensor or a tuple of tensors, each [B, ...]),
        reassembled in sample order."""
        high = sigma.float() * 1000.0 >= self.boundary_t  # WanPipeline's rule: t >= boundary_ratio * 1000
        n_high = int(high.sum())  # the one host sync of a call
        if n_high in (0, x.shape[0]):
            return fn(self.high if n_high else self.low, x, sigma, cond)
        parts = []
        for expert, idx in ((self.high, high.nonzero().squeeze(1)), (self.low, (~high).nonzero().squeeze(1))):
            out = fn(expert, x.index_select(0, idx), sigma.index_select(0, idx), cond.index_select(0, idx))
            parts.append((idx, out if isinstance(out, tuple) else (out,)))
        outs = [part.new_zeros((x.shape[0], *part.shape[1:])) for part in parts[0][1]]
        for idx, part in parts:
            outs = [o.index_copy(0, idx, p) for o, p in zip(outs, part)]
        return tuple(outs) if isinstance(out, tuple) else outs[0]

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return self._route(lambda m, *a: m(*a), x, sigma, cond)

    def features(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor, layer: int) -> torch.Tensor:
        return self._route(lambda m, *a: m.features(*a, layer), x, sigma, cond)

    def forward_features(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor, layer: int):
        return self._route(lambda m, *a: m.forward_features(*a, layer), x, sigma, cond)
