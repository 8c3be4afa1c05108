"""The gunicorn worker: one process, its event loop and request threads, and the socket parts
they share (heads read before a thread is taken, deadline sockets, replies sent by the loop,
keep-alive connections, graceful shutdown). Hosts the Falcon app; knows nothing of scoring."""
