"""Command line: `python -m dllm_fast COMMAND ...`; `python -m dllm_fast COMMAND --help` lists a command's options.

A command is a module with `main(argv)`, imported only when it is chosen, so that `--help` answers at once. A new
command registers with one line in COMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import sys

PROG = "python -m dllm_fast"

# name -> (module with main(argv), one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("dllm_fast.train.cli", "RL training; with no options, the embedded default (sudoku4 on CPU)"),
    "demo": ("dllm_fast.demo", "show what is built: rollouts, the fused log-prob op, the streaming backward"),
    "plan": ("dllm_fast.planning.cli", "plan a training step for a GPU on fake tensors: memory by phase, FLOPs, "
             "roofline time, the verdict and the largest settings that fit"),
}


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])
        return
    parser = argparse.ArgumentParser(prog=PROG, description="dllm_fast: fast rollouts and constant-memory "
                                     "likelihoods for RL on masked diffusion language models.",
                                     epilog=f"`{PROG} COMMAND --help` lists a command's options.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, (_, help_line) in COMMANDS.items():
        commands.add_parser(name, help=help_line)
    parser.parse_args(argv)  # --help, or an unknown command's error
    parser.print_help()


if __name__ == "__main__":
    main()
