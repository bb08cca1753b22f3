"""The SSD tier: file format (bytes only), index and capacity, restore into MLX, background writer."""
