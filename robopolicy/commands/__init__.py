"""One module per CLI subcommand; each exposes ``add_parser(subparsers)``."""
