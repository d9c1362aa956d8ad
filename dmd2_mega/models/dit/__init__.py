"""The DiT family (`family.py`: its `ModelFamily`, `DIT`): the model (`model.py`), the SiT / DiT checkpoint layouts
(`checkpoints.py`), the parameterisation adapters (`parameterization.py`) and the planner maths (`plan.py`).
Only `dmd2_mega.models` imports these modules (`.importlinter`)."""
from dmd2_mega.models.dit.family import DIT, DiTFamily
from dmd2_mega.models.dit.model import DiT, DiTBlock, DiTSpec

__all__ = ["DIT", "DiT", "DiTBlock", "DiTFamily", "DiTSpec"]
