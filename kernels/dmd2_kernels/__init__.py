"""Fused Triton kernels for the DMD2 hot path, each with a pure-torch path and reference.

Ops (one file each; maths and shapes in each module's docstring):
  x0_from_velocity(x_s, v, sigma)                          x_s - sigma * v              (x0_projection.py)
  cfg_x0(x_s, v_pos, v_neg, sigma, guidance)               CFG + x0, forward only       (cfg.py)
  flow_matching_loss(v_pred, x0, eps, sigma, space,
                     reduction="none")                     per-sample loss [B] or mean  (flow_matching.py)
  dmd_loss(x0hat, x0_real, x0_fake) -> (loss, DMDStats)    DMD grad + surrogate loss    (dmd.py)
  adaln_modulate(x, shift, scale)                          LayerNorm + adaLN modulation (adaln.py)
  qk_norm_rope(x, weight, cos, sin, head_dim, group=None)  Wan q/k RMSNorm (TP) + RoPE  (qk_norm_rope.py)
Every op takes ``impl=None | "triton" | "torch"``: None dispatches CUDA tensors to Triton and CPU
tensors to torch, unless ``DMD2_KERNELS=triton|torch`` (read once, at import; ``set_default_impl`` changes it)
forces one (see _utils.py). Each Triton path is a custom op ``torch.ops.dmd2.*`` with its backward registered, so
the ops sit in a torch.compile graph without breaking it. The ``*_ref`` functions are the eager multi-op
baselines (autograd through plain torch ops).

Import name: `dmd2_kernels` (the folder kernels/dmd2_kernels/ of the repository, mapped by setup.py). The name
`kernels` is Hugging Face's kernel-hub package, which transformers >= 5.25 requires and imports; nothing of ours
takes it (kernels/ has no __init__.py), so theirs is found from anywhere, the repository root included.
"""
from ._utils import KernelError, register_ops, resolve_impl, set_default_impl
from .adaln import adaln_modulate, adaln_modulate_ref
from .cfg import cfg_x0, cfg_x0_ref
from .dmd import DMDStats, dmd_loss, dmd_loss_ref
from .flow_matching import flow_matching_loss, flow_matching_loss_ref
from .qk_norm_rope import qk_norm_rope, qk_norm_rope_ref
from .x0_projection import x0_from_velocity, x0_from_velocity_ref

__all__ = [
    "x0_from_velocity", "cfg_x0", "flow_matching_loss", "dmd_loss", "adaln_modulate", "qk_norm_rope", "DMDStats",
    "KernelError", "register_ops", "resolve_impl", "set_default_impl", "x0_from_velocity_ref", "cfg_x0_ref",
    "flow_matching_loss_ref",
    "dmd_loss_ref", "adaln_modulate_ref", "qk_norm_rope_ref",
]
