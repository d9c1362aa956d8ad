"""Model families behind one contract (`family.py`: `ModelFamily`, `FamilyModel`, `DataShape`, `BuildOptions`,
`count_parameters`), the registry of families and named sizes (`registry.py`: `--model-size` -> (family, spec),
`build_model`, `family_of`), the families' sub-packages (`dit/`, `wan/`: only this package imports them) and the
shared layers: megatron-core tensor-parallel linears (`linears.py`), embeddings (`embeddings.py`), rotary tables
(`rope.py`), attention backends (`attention.py`), regional compilation (`compiled.py`), token splitting (`token_parallel.py`), diffusers folders
(`diffusers_folder.py`) and typed config reads (`config_keys.py`)."""
from dmd2_mega.models.family import (BuildOptions, DataShape, FamilyModel, ModelFamily, PlanMaths, Source,
                                     count_parameters)
from dmd2_mega.models.registry import (FAMILIES, MODEL_SIZES, ModelSize, build_model, family_of, get_size, get_spec,
                                       source_family)

__all__ = ["BuildOptions", "DataShape", "FAMILIES", "FamilyModel", "MODEL_SIZES", "ModelFamily", "ModelSize",
           "PlanMaths", "Source", "build_model", "count_parameters", "family_of", "get_size", "get_spec",
           "source_family"]
