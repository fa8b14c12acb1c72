"""ds4-mlx: a dedicated inference engine for DeepSeek V4 Flash GGUF files, on MLX."""

__version__ = "0.1.0"
