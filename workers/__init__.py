"""Everything that touches MLX: the worker, scheduler, model manager, backends, importers, demo builds."""
