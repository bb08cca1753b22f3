"""ipywidgets views over engine snapshots and events (no MLX in views)."""

from .dashboard import ResidencyDashboard
from .inspector import KVInspector
from .progress import GenerationProgress, TextProgress

__all__ = ["ResidencyDashboard", "GenerationProgress", "TextProgress", "KVInspector"]
