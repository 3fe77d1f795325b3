"""Compile ``MODULES`` now and print the build folder (on failure they run as Python)."""

import sys

import superinfer_jax.mypyc_build as compiled

if __name__ == "__main__":
    try:
        print(compiled.build())
    except Exception as e:  # mypy missing, no C compiler, a mypyc error: say which
        print(f"compiled modules not built (they run as plain Python): "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
