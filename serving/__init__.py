"""User-facing entry points: the ``superinfer`` command (generate, serve, batch), the gRPC
and OpenAI-compatible HTTP fronts, Prometheus metrics and the deployment config."""
