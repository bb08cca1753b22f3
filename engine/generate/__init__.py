"""Generating tokens: one generation, the token loop, sampling, logprobs, scoring and resuming (`batch/`: many rows at once; `speculative/`: drafts verified by the target)."""
