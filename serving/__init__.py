"""User-facing entry points: the ``superinfer`` command, servers (later), batch runs."""
