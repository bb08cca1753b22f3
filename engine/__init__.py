"""mlxcache_kernel.engine: models, the tiered prompt cache, storage, generation.

No Jupyter imports here: the engine works from a plain script too. A prompt
travels: `engine.py` (the facade) -> `run.py` (one generation) ->
`cache/tiered.py` (RAM over SSD) -> `cache/ram.py` and `cache/ssd/`
(`writer.py` -> `format.py` on disk, `restore.py` back into MLX), with the
KV state itself in `kv/` (`codecs.py` per mlx-lm cache class, `checkpoint.py`).
"""

from .engine import Engine, default_cache_dir, default_ram_budget
from .kv.checkpoint import Checkpoint
from .run import GenerationResult
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
