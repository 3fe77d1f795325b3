"""``python -m superinfer_jax.mypyc_build``: compile the scheduler, KV and simulator
modules with mypyc now (see ``superinfer_jax.mypyc_build``; ``make compiled`` runs it) and print
the build folder. A failure is not fatal: those modules then run as plain Python."""

import sys

import superinfer_jax.mypyc_build as compiled

if __name__ == "__main__":
    try:
        print(compiled.build())
    except Exception as e:  # mypy missing, no C compiler, a mypyc error: say which
        print(f"compiled modules not built (they run as plain Python): "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
