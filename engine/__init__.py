"""mlxcache_kernel.engine: models, the tiered prompt cache, storage, generation.

No Jupyter imports here: the engine works from a plain script too.
"""

from .checkpoint import Checkpoint
from .engine import Engine, GenerationResult, default_cache_dir, default_ram_budget
from .generation import GenerationError, SamplingParams
from .models import ModelError
from .sessions import SessionError

__all__ = [
    "Checkpoint",
    "Engine",
    "GenerationError",
    "GenerationResult",
    "ModelError",
    "SamplingParams",
    "SessionError",
    "default_cache_dir",
    "default_ram_budget",
]
