"""The state key: one name for a decision's state, shared by the prompt, the server and clients.

`state_json` is the state exactly as the direct-options-v1 prompt embeds it; `state_key` is the
sha256 (hex) of that text's UTF-8 bytes. Two requests have equal keys iff their prompts embed the
same state text, i.e. iff they can share a state prefix, so a router that hashes on the key
(`X-Semif-State-Key`) sends every question about one state to the replica that has it cached.
Pure Python, no torch: the HTTP layer and `semif_serve.client` import it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

STATE_KEY_HEADER = "X-Semif-State-Key"


def state_json(state: Any) -> str:
    """The state as it appears in the prompt (json.dumps, ensure_ascii=False, key order kept)."""
    return json.dumps(state, ensure_ascii=False)


def state_key(state: Any) -> str:
    """sha256 (64 lowercase hex digits) of `state_json(state)` encoded as UTF-8."""
    # A JSON string may hold a lone surrogate ("\ud800"); surrogatepass gives it bytes instead of
    # raising, so every state the JSON parser accepts has a key.
    text = state_json(state).encode("utf-8", "surrogatepass")
    return hashlib.sha256(text).hexdigest()
