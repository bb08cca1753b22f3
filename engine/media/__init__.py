"""Images, video and audio in the prompt: reading them as the model's processor does, their identity and the prompt's cache key."""
