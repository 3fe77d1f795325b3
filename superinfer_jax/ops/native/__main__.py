"""Build the native CPU ops now (``make install`` runs it) and print the library's path."""

import sys

from superinfer_jax.ops import native

if __name__ == "__main__":
    try:
        print(native.build())
    except (native.NativeBuildError, OSError) as e:  # OSError: the cache is not writable
        # Not fatal: the engine falls back to XLA's gathers. Say so, and exit non-zero.
        print(f"native ops not built (the engine will use XLA's gathers): {e}", file=sys.stderr)
        sys.exit(1)
