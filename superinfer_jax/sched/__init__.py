"""Scheduling: the scheduler, step plan, waiting queue, latency model, RotaSched."""
