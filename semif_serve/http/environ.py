"""The WSGI environ keys the worker sets for the app (semif_serve/worker/handling.py writes them,
the resources read them)."""

# A request's `peer_gone` check, for the app to call before scoring.
CLIENT_GONE_KEY = "semif.client_gone"

# Set (True) once the worker has begun its shutdown (SIGTERM): /health answers 503 "draining".
DRAINING_KEY = "semif.draining"
