"""Keep the Hugging Face libraries from ever reaching a model hub (contract INV-5, bug hunt S10).

huggingface_hub reads HF_HUB_OFFLINE once, when it is first imported, so the variables must be set
before torch or transformers load. `semif_serve/__init__.py` calls `force_offline()` first thing;
every loader also passes ``local_files_only=True``, which holds even if a caller imported
transformers before semif_serve.
"""

import os
import sys

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def force_offline() -> None:
    """Set the offline variables to 1, and the hub's constant too if it was already imported."""
    for name in OFFLINE_VARIABLES:
        os.environ[name] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
