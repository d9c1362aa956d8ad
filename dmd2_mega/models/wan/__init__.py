"""The Wan family (`family.py`: its `ModelFamily`, `WAN`): the model (`model.py`), Wan 2.2 A14B's two experts
(`experts.py`), the diffusers layout (`diffusers.py`), the export writer (`export.py`) and the planner maths
(`plan.py`). Only `dmd2_mega.models` imports these modules (`.importlinter`)."""
from dmd2_mega.models.wan.experts import WanExperts
from dmd2_mega.models.wan.family import WAN, WanFamily
from dmd2_mega.models.wan.model import DIFFUSERS_CLASS, Wan, WanSpec

__all__ = ["DIFFUSERS_CLASS", "WAN", "Wan", "WanExperts", "WanFamily", "WanSpec"]
