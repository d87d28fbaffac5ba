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
import json
from pathlib import Path

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
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def load_onnx_as_relax(path: str):
    """The Relax module of an ONNX file, weights as constants; UserError for bad input."""
    from ..cli import UserError

    file = Path(path)
    if not file.is_file():
        raise UserError(f"no such ONNX file: {path}")
    import onnx

    try:
        model = onnx.load(str(file))
        onnx.checker.check_model(model)
    except Exception as err:  # onnx raises DecodeError, ValidationError, ...
        raise UserError(f"{path} is not a valid ONNX model: {type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else ''}") from err
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    try:
        mod = from_onnx(model, keep_params_in_input=False)
    except Exception as err:
        raise UserError(f"TVM cannot import {path}: {type(err).__name__}: {err}") from err
    return relax.transform.Normalize()(mod)


def run(args: argparse.Namespace) -> int:
    from ..cli import UserError
    from ..relay_passes.derivation_transform import DerivationTransform

    if args.max_depth < 0 or args.max_states < 1 or args.time_limit <= 0:
        raise UserError("--max-depth must be >= 0, --max-states >= 1, --time-limit > 0")
    mod = load_onnx_as_relax(args.model)
    transform = DerivationTransform(max_depth=args.max_depth, max_states=args.max_states,
                                    time_limit_s=args.time_limit, seed=args.seed)
    _, results = transform.analyse(mod, apply=False)
    if args.json:
        print(json.dumps({"subprograms": [r.to_json() for r in results]}, indent=1))
        return 0
    if not results:
        print("no supported subprogram found")
    for r in results:
        _print_result(r)
    return 0


def _print_result(r) -> None:
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
        for c in sorted(o.candidates, key=lambda c: c.seconds):
            mark = "*" if c is o.chosen else " "
            rules = " > ".join(c.rules) or "-"
            print(f"   {mark} {c.seconds * 1e3:9.3f} ms  {c.label:10s} {' + '.join(c.ops)}"
                  f"  [{rules}]")
        for note in o.notes[-3:]:
            print(f"    note: {note}")
    print(f"  chosen: {r.est_time_s * 1e3:.3f} ms estimated vs {r.orig_time_s * 1e3:.3f} ms "
          f"original; verified: {r.verified} ({r.verification})")
