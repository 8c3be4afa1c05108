"""Between HTTP and the engine: admission (how many requests may be in progress) and the
decision service (request bodies → scorer rows → responses)."""
