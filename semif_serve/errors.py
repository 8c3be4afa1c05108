"""The exceptions that carry meaning across layers; the HTTP layer maps each to a status once.

Imports nothing, so every layer (runtime, engine, http) can raise and catch them.
"""


class ConfigError(ValueError):
    """A SEMIF_* variable is missing or invalid; the message starts with its name. Raised at
    startup only (`semif_serve.config`), before anything is bound: one line, exit 2."""


class StartupError(RuntimeError):
    """The service must not start (a device, load or warm-up check failed); the message says
    why and what to change. Raised by `semif_serve.engine.boot`: nothing is served."""


class ServeError(Exception):
    """Base class: the message is safe to show to the caller."""


class InvalidRequest(ServeError, ValueError):
    """The request cannot be scored as sent (shape, limits, a scorer ValueError) → 422.
    `field`: the segments of the field it names, when the raiser knows them (the ecosystem
    translators: `apis.fields.refused`); else the message's first words name it."""

    field: tuple[str | int, ...] = ()


class OptionCountUnsupported(InvalidRequest):
    """A question has more options (choices, levels) than the 16 option letters A..P → 422
    `option_count_unsupported`; never truncated."""


class BadRequest(ServeError):
    """The HTTP framing is malformed (a Content-Length that is not ASCII digits) → 400."""


class Unauthorized(ServeError):
    """Missing or wrong bearer token → 401."""


class IncompleteBody(ServeError):
    """The body ended before its declared Content-Length (the client half-closed) → 400."""


class RequestTimeout(ServeError):
    """The request's body did not arrive within SEMIF_BODY_TIMEOUT_S → 408."""


class UnsupportedEncoding(ServeError):
    """The body's Content-Encoding is not one the server decodes (identity, gzip, zstd) → 415."""


class RequestTooLarge(ServeError):
    """The body is over SEMIF_MAX_BODY_BYTES → 413."""


class Overloaded(ServeError):
    """A refusal the caller may retry later; `retry_after_s` is the server's estimate of when
    its request could be served (None: no estimate yet), sent as Retry-After."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ServerBusy(Overloaded):
    """SEMIF_MAX_QUEUE requests are already in progress, or the queue ahead of a request holds
    more work than its timeout allows → 429."""


class ConfigurationChanged(ServeError):
    """A request of several engine calls found its model reconfigured (a `PUT` changed its
    weights, dtype or max_tokens) after its first call: it fails whole, before any answer is
    returned, never answered by two configurations → 503; a retry runs under the new one."""


class ServerStarting(ServeError):
    """The worker's startup models are still loading; every route but /health → 503."""


class OutOfMemory(ServeError):
    """The accelerator ran out of memory during scoring; the process stays up → 503."""


class ScoringFailed(ServeError):
    """The scorer failed for another reason, or the response could not be built → 500."""


class Forbidden(ServeError):
    """A management call without the admin token → 403."""


class ModelNotFound(ServeError):
    """No model is registered under that id → 404."""


class BadManagementRequest(ServeError):
    """A management call that cannot be applied (bad spec, unsupported slots) → 400."""


class QueueTimedOut(Overloaded):
    """A request or manager waited past the queue timeout and left the queue → 503."""


class InsufficientMemory(ServeError):
    """A model cannot be loaded: the residency limit is reached and nothing is idle → 503."""


class ModelLoadFailed(ServeError):
    """A model could not be loaded (bad weights, a failed warm-up); it serves nothing → 503.
    `public`: what a scoring request is told (the model and the kind of failure, never a server
    path); the message itself (the log, the management call that loaded it, `last_load_error`)
    says all."""

    def __init__(self, message: str, public: str | None = None):
        super().__init__(message)
        self.public = public


class ClientGone(ServeError):
    """The client closed its connection while its request waited: it is dropped unscored → 499
    (nginx's "client closed request"; no one receives it, the access log and /metrics do)."""


# A batched request whose caller left while its batch ran, before its own forward did: never run.
LEFT_BEFORE_FORWARD = "the client closed its connection before its forward ran"


def told_to_callers(error: BaseException) -> BaseException:
    """`same_failure(error)` as a scoring request is told it: a load failure's `public`
    message when it has one."""
    public = getattr(error, "public", None)
    return type(error)(public) if public else same_failure(error)


def same_failure(error: BaseException) -> BaseException:
    """A fresh exception saying what `error` says, for another thread to raise (one instance
    raised in several threads would share, and garble, its traceback)."""
    try:
        copy = type(error)(*error.args)
        copy.__dict__.update(error.__dict__)  # what the error carries besides its message
        return copy
    except Exception:
        return RuntimeError(str(error))
