"""Speculative decoding: a draft proposes tokens, the target verifies them in one forward, rejected tokens are cut back exactly."""
