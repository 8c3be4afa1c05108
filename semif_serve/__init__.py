"""semif-serve: SemIf's direct-options-v1 decisions from an open LLM, one forward pass each.

Importing the package forces the Hugging Face libraries offline (see `offline`), so every way
of starting semif-serve (console script, ``python -m``, gunicorn, tests) loads weights from local
files only.
"""

from semif_serve import offline as _offline

_offline.force_offline()

__version__ = "0.1.0"
