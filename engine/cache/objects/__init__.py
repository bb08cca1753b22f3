"""Exact tensor objects on the prompt cache's tiers (`Engine.objects`, `@memo`, image encoder outputs).

`values.py` what a key and a value are (no cache), `cache.py` the object cache
over the tiered cache, `remote.py` objects on the shared Redis / Valkey tier.
"""
