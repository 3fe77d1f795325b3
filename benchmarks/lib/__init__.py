"""Shared code of the runnable benchmarks (``python -m benchmarks.NAME``); the
workloads, metrics and clients that ``superinfer simulate`` and ``superinfer bench`` use
live in the package (``superinfer_jax.sim``, ``serving.bench``)."""
