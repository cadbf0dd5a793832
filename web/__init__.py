"""Web tier: the Flask app (never imports MLX)."""
