"""A typed Python client for semif-serve's `/decide`, `/decide/shared`, `/health` and
`/v1/models` (docs/client.md): `Client` blocks, `AsyncClient` awaits; both pool connections,
send the bearer token and each body's X-Semif-State-Key (or the caller's X-Semif-Session),
retry 429, 503 `server_busy` and refused connections with jittered backoff within one deadline,
tell the server its share of that deadline (each body's `timeout_s`), end every attempt by it,
and raise `SemifError`s.
"""

from semif_serve.client.aio import AsyncClient
from semif_serve.client.errors import ApiError, ConnectionFailed, InvalidReply, SemifError
from semif_serve.client.retry import RetryPolicy
from semif_serve.client.sync import DEFAULT_URL, Client
from semif_serve.client.types import (
    AveragedResult,
    DecideReply,
    DecideRequest,
    DecisionSpec,
    Health,
    ModelList,
    ModelStatus,
    OptionSpec,
    Result,
    SharedReply,
    SharedRequest,
)
from semif_serve.session import SESSION_HEADER
from semif_serve.state_key import STATE_KEY_HEADER, state_key

__all__ = [
    "DEFAULT_URL",
    "SESSION_HEADER",
    "STATE_KEY_HEADER",
    "ApiError",
    "AsyncClient",
    "AveragedResult",
    "Client",
    "ConnectionFailed",
    "DecideReply",
    "DecideRequest",
    "DecisionSpec",
    "Health",
    "InvalidReply",
    "ModelList",
    "ModelStatus",
    "OptionSpec",
    "Result",
    "RetryPolicy",
    "SemifError",
    "SharedReply",
    "SharedRequest",
    "state_key",
]
