"""A call's first step: its arguments as one request (request.py), checked (checks.py; the KV-cache and paged
arguments: cache_checks.py), its options (options.py), the modes it runs under (modes.py, invariance.py) and the spec
every cache keys on (spec.py). Imports nothing of the later steps (planning, launch, run)."""
