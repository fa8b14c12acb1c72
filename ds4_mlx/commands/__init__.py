"""One module per `ds4-mlx` subcommand; see `ds4_mlx.cli`."""
