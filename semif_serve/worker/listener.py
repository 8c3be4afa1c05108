"""The master's listening socket on SEMIF_BIND, bound once before anything is logged."""

from __future__ import annotations

import errno
from typing import Any

from gunicorn import sock as gunicorn_sock

from semif_serve.config import ConfigError


def listen(cfg: Any, log: Any) -> Any:
    """gunicorn's listener on SEMIF_BIND, bound once: a ConfigError naming SEMIF_BIND when it
    cannot be (gunicorn's own bind tries five times, a second apart, then says "Can't
    connect")."""
    address, bind = cfg.address[0], cfg.bind[0]
    try:
        return gunicorn_sock._sock_type(address)(address, cfg, log)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"SEMIF_BIND: {bind} is already in use (is another semif-serve running there?); "
                "stop it, or set SEMIF_BIND to a free HOST:PORT"
            ) from None
        raise ConfigError(f"SEMIF_BIND: cannot listen on {bind}: {error}") from None
