"""Resident models: the registry (loading through mlx-lm, identity), the GGUF converter, and vision-language models through mlx-vlm."""
