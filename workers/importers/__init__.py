"""Importers that turn GGUF and CTranslate2 files into MLX model directories."""
