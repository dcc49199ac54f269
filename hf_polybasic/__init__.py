"""hf_polybasic: polybasic (multi-model) speculative decoding inside Hugging Face `model.generate`.

Importing this package patches nothing. Use either transformers' own extension point::

    out = target.generate(**inputs, custom_generate=hp.generate, assistant_models=[mid, draft])

or opt in once per model with `enable`::

    hp.enable(target)
    out = target.generate(**inputs, assistant_models=[mid, draft], polybasic_config=hp.PolybasicConfig())
"""

from . import drafters, levels
from .config import PolybasicConfig
from .integration import PolybasicGenerateOutput, disable, enable, generate, last_stats
from .stats import LevelStats, PolybasicStats

__all__ = [
    "drafters",
    "levels",
    "LevelStats",
    "PolybasicConfig",
    "PolybasicGenerateOutput",
    "PolybasicStats",
    "disable",
    "enable",
    "generate",
    "last_stats",
]
__version__ = "0.1.0"
