"""The simulator's benchmarks, one entry point with a subcommand each.

    python -m benchmarks.sim paper [--quick] --preset paper-qwen32b-sharegpt
        # policy sweeps at paper scale: the same command as ``superinfer simulate``
    python -m benchmarks.sim sweep [--quick] [--workload multiturn|trace]
        # ``policy_sweep``'s workloads and seeds on this machine's calibrated cost model
    python -m benchmarks.sim validate [--quick]
        # the simulator against the real engine on this machine, per policy
    python -m benchmarks.sim speed [--quick] [--scenarios knee]
        # how fast the simulator runs, and where its host time goes

Each prints its table and writes JSON (``--out``); ``python -m benchmarks.sim NAME -h``
shows a subcommand's flags and what it measures.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {  # name -> module with main(argv)
    "sweep": "benchmarks.lib.sim_sweep",
    "validate": "benchmarks.lib.sim_validation",
    "speed": "benchmarks.lib.sim_speed",
}


def paper(argv: list[str]) -> int:
    """``superinfer simulate``, with ShareGPT's default tokenizer."""
    from serving.bench.sharegpt import default_tokenizer
    from superinfer_jax.sim import cli

    p = argparse.ArgumentParser(prog="python -m benchmarks.sim paper", description=cli.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_arguments(p)
    return cli.run(p.parse_args(argv), load_tokenizer=default_tokenizer)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = ("paper", *SUBCOMMANDS)
    if not argv or argv[0] not in names:
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    if argv[0] == "paper":
        return paper(argv[1:])
    return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    raise SystemExit(main())
