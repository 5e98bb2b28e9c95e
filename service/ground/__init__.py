"""The ground floor of the service: errors as the service's own kinds, deadlines, settings, metrics, tracing and logs.
It imports nothing of the service above it (tests/test_layers.py)."""
