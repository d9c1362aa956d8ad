"""Tensor-parallel linear layers of the DiT and Wan families: megatron-core local or transformer-engine.

`column(...)` splits the output dim across TP ranks (weight [out/TP, in], partition_dim 0);
`row(...)` splits the input dim (weight [out, in/TP], partition_dim 1) and all-reduces its output.
Weights are initialised on the CPU as the full TP=1 master matrix from the default RNG and then
sliced (megatron-core's `use_cpu_initialization`), so a TP=2 model starts from exactly the TP=1
weights. Both return a plain tensor (bias added), unlike megatron's (output, bias) tuple. At TP = 1 (the whole
matrix on the rank) the forward is one `F.linear` (`AdaptableLinear._whole`): megatron-core's layer holds the weights,
its autograd Functions run only where there is TP communication.
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


class AdaptableLinear(torch.nn.Module):
    """A megatron-core (or transformer-engine) parallel linear returning one tensor: its separately returned bias
    (if any) added; optionally all-gathers a column-parallel output over TP (via megatron_compat, which runs on CPU
    too). `attach` gives it a low-rank adapter (`models/lora.py`), whose delta joins the output before the linear's
    TP reduction."""

    def __init__(self, inner: torch.nn.Module, kind: str, in_features: int, out_features: int,
                 gather: bool = False, impl: str = "local"):
        super().__init__()
        self.inner, self.gather, self.kind, self.impl = inner, gather, kind, impl
        self.in_features, self.out_features = in_features, out_features
        self.lora = None
        # the whole matrix on this rank (TP = 1): no TP communication, so the forward is `_whole`
        self.whole = impl == "local" and tuple(inner.weight.shape) == (out_features, in_features)

    @property
    def weight(self):
        return self.inner.weight

    @property
    def bias(self):
        return self.inner.bias

    def attach(self, lora: torch.nn.Module) -> None:
        if self.impl != "local":
            raise ConfigError("LoRA adapters sit on megatron-core's local linears; give --transformer-impl local "
                              f"(got {self.impl})")
        if self.gather:
            raise ConfigError("LoRA adapts the blocks' attention and FFN linears, not a gathered-output one")
        self.lora = lora

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's shard of x @ W^T (plus the adapter's delta) with no TP communication and no bias: sequence
        parallelism (`models/token_parallel.py`) gathers the input / reduce-scatters the output itself."""
        out = torch.nn.functional.linear(x, self.inner.weight)
        return out if self.lora is None else out + self.lora.delta(x)

    def forward(self, x):
        if self.whole:
            return self._whole(x)
        if self.lora is not None:
            return self._adapted(x)
        out, bias = self.inner(x)
        out = out if bias is None else out + bias
        return gather_from_tp(out) if self.gather else out

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        """The TP = 1 forward: x @ W^T + b in one `F.linear` (one addmm; its backward two matmuls and the bias's
        sum), the adapter's delta last. megatron-core's autograd Functions add nothing at TP = 1 but a separate bias
        add, a copy in backward and host-side group lookups, which also break a torch.compile graph."""
        out = torch.nn.functional.linear(x, self.inner.weight, self.inner.bias)
        return out if self.lora is None else out + self.lora.delta(x)

    def _adapted(self, x: torch.Tensor) -> torch.Tensor:
        """megatron-core's local column / row forward (matmul, then the bias) with the adapter's delta added where
        the base's output is this rank's: the column's input gradient all-reduced once, the row's partial output
        all-reduced once, as without the adapter."""
        w, b = self.inner.weight, self.inner.bias
        if self.kind == "column":
            x = tensor_parallel.copy_to_tensor_model_parallel_region(x)
            out = torch.matmul(x, w.t())
            out = out if b is None else out + b
            return out + self.lora.delta(x)
        out = tensor_parallel.reduce_from_tensor_model_parallel_region(torch.matmul(x, w.t()) + self.lora.delta(x))
        return out if b is None else out + b


def column(in_f: int, out_f: int, config: TransformerConfig, init_method, impl: str = "local",
           gather_output: bool = False) -> torch.nn.Module:
    if impl == "transformer_engine" and not gather_output:
        require_transformer_engine()
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear
        return AdaptableLinear(TEColumnParallelLinear(in_f, out_f, config=config, init_method=init_method,
                                                      gather_output=False, bias=True, skip_bias_add=False,
                                                      is_expert=False), "column", in_f, out_f, impl=impl)
    return AdaptableLinear(tensor_parallel.ColumnParallelLinear(
        in_f, out_f, config=config, init_method=init_method, bias=True, gather_output=False), "column", in_f, out_f,
        gather=gather_output)


def row(in_f: int, out_f: int, config: TransformerConfig, init_method, impl: str = "local") -> torch.nn.Module:
    if impl == "transformer_engine":
        require_transformer_engine()
        from megatron.core.extensions.transformer_engine import TERowParallelLinear
        return AdaptableLinear(TERowParallelLinear(in_f, out_f, config=config, init_method=init_method, bias=True,
                                                   input_is_parallel=True, skip_bias_add=False, is_expert=False),
                               "row", in_f, out_f, impl=impl)
    return AdaptableLinear(tensor_parallel.RowParallelLinear(
        in_f, out_f, config=config, init_method=init_method, bias=True, input_is_parallel=True,
        skip_bias_add=False), "row", in_f, out_f)
