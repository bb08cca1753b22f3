"""Passages placed anywhere in a prompt from their cached KV, a chosen fraction recomputed: `prompt.py` the
prompt and each passage's span, `moves.py` moving keys by rotation, `store.py` each passage's KV as an object,
`blend.py` placing and recomputing, `run.py` the order of work. Approximate, opt-in, never an exact prefix."""
