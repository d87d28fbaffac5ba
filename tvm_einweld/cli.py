"""Command-line entry point: `python -m tvm_einweld <subcommand> ...`.

Each subcommand lives in `tvm_einweld/commands/<name>.py` and exposes
`HELP: str`, `add_arguments(parser)` and `run(args) -> int`. Modules are imported only when
their subcommand runs, so `--help` stays fast and one broken area cannot break the others.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from typing import Optional, Sequence

# name -> (module, one-line help). The help lives here so `--help` needs no imports.
SUBCOMMANDS = {
    "demo": ("tvm_einweld.commands.demo", "run the main job on a built-in model"),
    "optimize": ("tvm_einweld.commands.optimize",
                 "optimize an ONNX model with the einweld pipeline and export the library"),
    "derive": ("tvm_einweld.commands.derive",
               "run the derivation search on every subprogram of an ONNX model"),
    "tune": ("tvm_einweld.commands.tune",
             "tune with adaptive layout strategies: an ONNX model or one conv2d task"),
    "verify": ("tvm_einweld.commands.verify",
               "self-check the verifier: canonical ops and planted faults"),
    "bench": ("tvm_einweld.commands.bench",
              "benchmark the model zoo side by side with stock TVM and onnxruntime"),
}


class UserError(Exception):
    """A problem with the user's input: printed as one clear line, never a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tvm_einweld",
        description="tvm_einweld: EinNet derivations, Welder tile fusion and adaptive layout "
        "tuning for Apache TVM, with every rewrite verified.",
    )
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        # Arguments are added lazily by _load(); parse_known_args keeps --help cheap.
    return parser


class _Elapsed(logging.Formatter):
    """'[  12.3 s] message': seconds since the command started."""

    def __init__(self) -> None:
        super().__init__()
        self.start = time.perf_counter()

    def format(self, record: logging.LogRecord) -> str:
        return f"[{time.perf_counter() - self.start:7.1f} s] {record.getMessage()}"


def show_progress() -> None:
    """Progress of long stages on stderr, elapsed seconds first, so stdout (--json) stays
    clean (the commands log it to `tvm_einweld.progress`)."""
    progress = logging.StreamHandler(sys.stderr)
    progress.setFormatter(_Elapsed())
    logger = logging.getLogger("tvm_einweld.progress")
    logger.addHandler(progress)
    logger.setLevel(logging.INFO)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in SUBCOMMANDS:
        args = parser.parse_args(argv)  # prints help / errors for unknown commands
        parser.print_help()
        return 0 if args.command is None and not argv else 2
    name = argv[0]
    module = importlib.import_module(SUBCOMMANDS[name][0])
    sub = argparse.ArgumentParser(prog=f"python -m tvm_einweld {name}", description=module.HELP)
    module.add_arguments(sub)
    args = sub.parse_args(argv[1:])
    show_progress()
    try:
        return int(module.run(args) or 0)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
