"""Everything that touches MLX: the worker, its scheduler and model manager, backends, importers."""
