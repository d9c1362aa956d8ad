"""Model families behind one interface (`family.py`: `FamilyModel`, `ModelFamily`, `DataShape`,
`BuildOptions`, `count_parameters`), the registry of named sizes (`registry.py`: `--model-size` ->
(family, spec), `build_model`), and the DiT family (`dit.py`) with its megatron-core tensor-parallel
linears (`linears.py`), embeddings (`embeddings.py`) and attention backends (`attention.py`)."""
from dmd2_mega.models.dit import DIT, DiT, DiTSpec
from dmd2_mega.models.family import BuildOptions, DataShape, FamilyModel, ModelFamily, count_parameters
from dmd2_mega.models.registry import MODEL_SIZES, ModelSize, build_model, get_size, get_spec

__all__ = ["BuildOptions", "DIT", "DataShape", "DiT", "DiTSpec", "FamilyModel", "MODEL_SIZES", "ModelFamily",
           "ModelSize", "build_model", "count_parameters", "get_size", "get_spec"]
