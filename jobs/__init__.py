"""The contract shared by web and workers: settings, Redis, queues, events, the model catalog (never imports MLX)."""
