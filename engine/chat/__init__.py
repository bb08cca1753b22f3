"""Chat: prompts through the model's template, sessions (conversation history) and previews of cached prefixes."""
