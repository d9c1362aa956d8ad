"""Tensor-parallel linear layers for the DiT: megatron-core local or transformer-engine.

`column(...)` splits the output dim across TP ranks (weight [out/TP, in], partition_dim 0);
`row(...)` splits the input dim (weight [out, in/TP], partition_dim 1) and all-reduces its output.
Weights are initialised on the CPU as the full TP=1 master matrix from the default RNG and then
sliced (megatron-core's `use_cpu_initialization`), so a TP=2 model starts from exactly the TP=1
weights. Both return a plain tensor (bias added), unlike megatron's (output, bias) tuple.
"""
from __future__ import annotations

import importlib.util

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer import TransformerConfig

from dmd2_mega.errors import ConfigError
from dmd2_mega.distributed.megatron_compat import gather_from_tp


def megatron_config(hidden_size: int, num_layers: int, num_heads: int, tp_size: int,
                    bf16: bool = False) -> TransformerConfig:
    """The megatron-core config the tensor-parallel layers read (init on CPU, no fusions)."""
    return TransformerConfig(
        num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_heads,
        tensor_model_parallel_size=tp_size, use_cpu_initialization=True, perform_initialization=True,
        params_dtype=torch.float32, bf16=bf16, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False,
    )


def require_transformer_engine() -> None:
    if importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError("--transformer-impl transformer_engine needs the transformer-engine package, "
                          "which is not installed (pip install 'dmd2-mega[gpu]' or use --transformer-impl local)")
    if not torch.cuda.is_available():
        raise ConfigError("--transformer-impl transformer_engine needs CUDA; use --transformer-impl local on CPU")


class _Unwrap(torch.nn.Module):
    """Adds megatron's separately returned bias (if any) and returns one tensor; optionally
    all-gathers a column-parallel output over TP (via megatron_compat, which runs on CPU too)."""

    def __init__(self, inner: torch.nn.Module, gather: bool = False):
        super().__init__()
        self.inner, self.gather = inner, gather

    @property
    def weight(self):
        return self.inner.weight

    @property
    def bias(self):
        return self.inner.bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's shard of x @ W^T with no TP communication and no bias: sequence parallelism
        (`models/token_parallel.py`) gathers the input / reduce-scatters the output itself."""
        return torch.nn.functional.linear(x, self.inner.weight)

    def forward(self, x):
        out, bias = self.inner(x)
        out = out if bias is None else out + bias
        return gather_from_tp(out) if self.gather else out


def column(in_f: int, out_f: int, config: TransformerConfig, init_method, impl: str = "local",
           gather_output: bool = False) -> torch.nn.Module:
    if impl == "transformer_engine" and not gather_output:
        require_transformer_engine()
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear
        return _Unwrap(TEColumnParallelLinear(in_f, out_f, config=config, init_method=init_method,
                                              gather_output=False, bias=True, skip_bias_add=False,
                                              is_expert=False))
    return _Unwrap(tensor_parallel.ColumnParallelLinear(
        in_f, out_f, config=config, init_method=init_method, bias=True, gather_output=False), gather=gather_output)


def row(in_f: int, out_f: int, config: TransformerConfig, init_method, impl: str = "local") -> torch.nn.Module:
    if impl == "transformer_engine":
        require_transformer_engine()
        from megatron.core.extensions.transformer_engine import TERowParallelLinear
        return _Unwrap(TERowParallelLinear(in_f, out_f, config=config, init_method=init_method, bias=True,
                                           input_is_parallel=True, skip_bias_add=False, is_expert=False))
    return _Unwrap(tensor_parallel.RowParallelLinear(
        in_f, out_f, config=config, init_method=init_method, bias=True, input_is_parallel=True,
        skip_bias_add=False))
