"""Examples: complete, runnable pieces to copy from (``docs/research.md``)."""
