"""States a user names: named checkpoints, session states, KV inspection, and the check on user-chosen names."""
