"""KV state: per-class codecs, the immutable checkpoint, token-prefix helpers, inspection."""
