"""`python -m tvm_einweld derive MODEL.onnx`: EinNet's derivation search on every subprogram.

Imports the ONNX model into Relax, splits it into subprograms at activations and runs
`DerivationTransform`'s analysis on each: the search, the candidate programs with their
estimated cost, the chosen one, and whether the chosen rewrite was verified. Nothing is written
back; `--json` prints one JSON object: {"subprograms": [{"ops", "chosen": {"ops", "rules",
"verified", "orig_time_s", "est_time_s"}, "candidates", "stats": {"states", "pruned",
"seconds"}}]}.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import Sequence

from .model_input import add_input_shape_argument

HELP = "run the derivation search on every subprogram of an ONNX model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="path to an .onnx file")
    parser.add_argument("--max-depth", type=int, default=7,
                        help="maximum rule applications of the explorative search (default 7)")
    parser.add_argument("--max-states", type=int, default=400,
                        help="maximum search states per operator (default 400)")
    parser.add_argument("--time-limit", type=float, default=5.0,
                        help="search seconds per operator (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="search seed (default 0)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object on stdout (progress and notes on stderr)")
    add_input_shape_argument(parser)


def load_onnx_as_relax(path: str, input_shape: Sequence[str] = ()):
    """The Relax module of an ONNX file, weights as constants, dynamic input dimensions bound
    (`--input-shape` specs, 1 otherwise); UserError for bad input."""
    from .model_input import load, read_onnx

    return load(read_onnx(path), path, input_shape, say=lambda _: None)[1]


def run(args: argparse.Namespace) -> int:
    from ..cli import UserError
    from ..relay_passes.derivation_transform import DerivationTransform
    from .model_input import load, read_onnx

    if args.max_depth < 0 or args.max_states < 1 or args.time_limit <= 0:
        raise UserError("--max-depth must be >= 0, --max-states >= 1, --time-limit > 0")
    # With --json, stdout holds the JSON object alone: everything else goes to stderr.
    say = functools.partial(print, file=sys.stderr if args.json else sys.stdout, flush=True)
    _, mod = load(read_onnx(args.model), args.model, args.input_shape, say)
    transform = DerivationTransform(max_depth=args.max_depth, max_states=args.max_states,
                                    time_limit_s=args.time_limit, seed=args.seed)
    _, results = transform.analyse(mod, apply=False)  # progress per subprogram on stderr
    if args.json:
        print(json.dumps({"subprograms": [r.to_json() for r in results]}, indent=1))
        return 0
    if not results:
        print("no supported subprogram found")
    for r in results:
        _print_result(r)
    return 0


def _print_result(r) -> None:
    from .model_input import plain_note

    sub = r.subprogram
    print(f"subprogram {sub.function}#{sub.index}: {', '.join(sub.kinds)}")
    for o in r.ops:
        s = o.stats
        if s is not None:
            print(f"  {o.op.kind}: {s.states} states, {s.pruned} pruned by fingerprint "
                  f"({100 * s.pruned_fraction:.0f}%), {s.seconds:.2f} s, stopped by "
                  f"{s.stopped_by}")
        for depth, est, rules in o.best_per_depth:
            print(f"    best at depth {depth}: {est * 1e3:.3f} ms by the roofline estimate  "
                  f"[{' > '.join(rules) or '-'}]")
        if len(o.candidates) > 1:
            # The estimate's favourite is verified and timed before it is kept, so the chosen
            # candidate need not be the first line: the legend says what each mark means.
            print("    candidates by estimated time (* chosen: verified and, where timed, "
                  "measured faster than the original; x timed and not faster)")
        for c in sorted(o.candidates, key=lambda c: c.seconds):
            mark = "*" if c is o.chosen else "x" if any(c is t for t in o.tried) else " "
            rules = " > ".join(c.rules) or "-"
            print(f"   {mark} {c.seconds * 1e3:9.3f} ms  {c.label:10s} {' + '.join(c.ops)}"
                  f"  [{rules}]")
        for note in dict.fromkeys(plain_note(n) for n in o.notes):  # once each, in order
            print(f"    note: {note}")
    measured = ""
    if r.measured_before_s is not None and r.measured_after_s is not None:
        which = "rewritten" if r.applied else "for the last rewrite tried, not applied"
        measured = (f"; measured {r.measured_after_s * 1e3:.3f} ms {which} vs "
                    f"{r.measured_before_s * 1e3:.3f} ms original")
    print(f"  chosen: {r.est_time_s * 1e3:.3f} ms estimated vs {r.orig_time_s * 1e3:.3f} ms "
          f"original{measured}; verified: {r.verified} ({plain_note(r.verification)})")
