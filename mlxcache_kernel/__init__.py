"""mlxcache-kernel: a Jupyter kernel keeping MLX models and a tiered prompt cache resident."""

__version__ = "0.1.0"
