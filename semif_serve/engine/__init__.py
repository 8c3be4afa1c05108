"""The engine: one model on one device behind its lock, and what builds, loads, warms and guards
it (boot from a model spec, the built-in model's conversion and snapshot manifest, the torch
scorer, the one out-of-memory policy, the kernel cache, native memory). Knows nothing of HTTP."""
