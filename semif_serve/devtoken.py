"""A local token for `make serve`: random, in a file only the user can read, with a curl example."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from semif_serve.config import parse_token


def ensure_token_file(path: Path) -> str:
    """The token stored at `path`, creating a fresh random one (mode 0600) when missing."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return parse_token(path.read_text(encoding="ascii").strip())
    token = secrets.token_urlsafe(32)  # 43 characters of [A-Za-z0-9_-]
    with os.fdopen(descriptor, "w", encoding="ascii") as handle:
        handle.write(token + "\n")
    return token


def curl_example(bind: str, token_file: Path) -> str:
    body = (
        '{"id": "door", "state": "The front door is wide open.", '
        '"question": "Is the door open?", '
        '"options": [{"id": "yes", "description": "Yes"}, {"id": "no", "description": "No"}]}'
    )
    return (
        f"semif-serve: API token in {token_file} (readable only by you). Try:\n\n"
        f"  curl -s http://{bind}/decide \\\n"
        f'    -H "Authorization: Bearer $(cat {token_file})" \\\n'
        f"    -H 'Content-Type: application/json' \\\n"
        f"    -d '{body}'\n"
    )
