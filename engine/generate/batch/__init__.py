"""Many prompts at once: rows over shared prefixes (shared.py), rows merged in mlx-lm's batch (merged.py), and the run over both (run.py)."""
