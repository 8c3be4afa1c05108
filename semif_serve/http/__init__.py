"""The Falcon WSGI app: routes, auth, admission, body reading, the error envelope, request logs.

Knows nothing of torch: it talks to a `DecisionService` and maps `semif_serve.errors` to statuses.
"""

from semif_serve.http.app import create_app

__all__ = ["create_app"]
