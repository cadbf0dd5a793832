"""Everything that touches MLX: the worker, engine, backends, importers."""
