"""Quality tools over labelled decisions: `evaluate`, `calibrate` and `accept`.

This package sits above scoring and HTTP: it reads labelled data, asks a backend (a running server
over HTTP, or a local model through the project's own scorers) for decisions, and turns the
answers into statistics and pass/fail checks. Nothing below it imports it.
"""
