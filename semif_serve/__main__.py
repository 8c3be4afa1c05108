"""`python -m semif_serve` is the `semif-serve` command."""

from semif_serve.cli import entry_point

entry_point()
