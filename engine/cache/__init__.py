"""The tiered prompt cache: RAM tier, SSD tier (ssd/), and the policy over both (tiered.py)."""
