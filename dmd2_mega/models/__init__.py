"""The DiT (`dit.py`) on megatron-core tensor-parallel linears (`linears.py`), its embeddings,
attention backends and the registry of named sizes."""
from dmd2_mega.models.dit import DiT, count_parameters, tp_partition_dim
from dmd2_mega.models.registry import MODEL_SIZES, DiTSpec, get_spec

__all__ = ["DiT", "DiTSpec", "MODEL_SIZES", "count_parameters", "get_spec", "tp_partition_dim"]
