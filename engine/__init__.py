"""mlxcache_kernel.engine: models, the tiered prompt cache, storage, generation.

No Jupyter imports here: the engine works from a plain script too. A prompt
travels: `engine.py` (the facade) -> `generate/generation.py` (one generation,
whose tokens come from the loop in `generate/`) -> `cache/tiered.py` (RAM over
SSD) -> `cache/ram.py` and `cache/ssd/` (`cache/ssd/writer.py` -> `cache/ssd/persist.py` on
disk, `cache/ssd/restore.py` back into MLX), with the KV state itself in `kv/`
(`kv/codecs.py` per mlx-lm cache class, `kv/checkpoint.py`). Every exception a caller sees is in `errors.py`.
"""

import importlib

# Imported on first use (PEP 562): a process that needs only the storage layer
# (a cache maintenance tool, the crash tests' workers) does not load MLX.
_EXPORTS = {
    "ConfigError": ".errors",
    "RemoteConfigError": ".errors",
    "ModelError": ".errors",
    "VisionUnavailable": ".errors",
    "GenerationError": ".errors",
    "ConstraintError": ".errors",
    "PassageError": ".errors",
    "SessionError": ".errors",
    "ToolError": ".errors",
    "CheckpointNameError": ".errors",
    "UnsupportedCache": ".errors",
    "Unkeyable": ".errors",
    "Unstorable": ".errors",
    "CatalogBusy": ".errors",
    "CatalogCorrupt": ".errors",
    "ReadBusy": ".errors",
    "ReadCorrupt": ".errors",
    "CorruptCheckpoint": ".errors",
    "NewerFormat": ".errors",
    "CorruptBlock": ".errors",
    "UnsupportedFilesystem": ".errors",
    "LinkedDirectory": ".errors",
    "CheckpointUnavailable": ".errors",
    "RemoteError": ".errors",
    "Checkpoint": ".kv.checkpoint",
    "Engine": ".engine",
    "GenerationResult": ".generate.generation",
    "SamplingParams": ".generate.sampling",
    "ScoreResult": ".generate.scoring",
    "TokenLogprob": ".generate.logprobs",
    "ToolCall": ".chat.tools",
    "default_cache_dir": ".config",
    "default_ram_budget": ".host.memory",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
