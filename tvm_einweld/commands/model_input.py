"""Reading the user's ONNX model, the same way in every command: one wording for each bad
input, `--input-shape` to bind dynamic dimensions, and the Relax import."""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Callable, List, Sequence, Tuple


def add_input_shape_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-shape", action="append", default=[], metavar="NAME:1x3x224x224",
                        help="bind the dynamic dimensions of input NAME to these sizes "
                             "(repeatable, or comma-separated); the dynamic dimensions of an "
                             "input without one are bound to 1")


def read_onnx(path: str):
    """The checked ONNX model at `path`; UserError for a missing file, a directory or a file
    that is not ONNX."""
    import onnx

    from ..cli import UserError

    file = Path(path)
    if file.is_dir():
        raise UserError(f"{path} is a directory, not an ONNX file")
    if not file.is_file():
        raise UserError(f"no such ONNX file: {path}")
    try:
        model = onnx.load(str(file))
        onnx.checker.check_model(model)
    except Exception as err:  # onnx raises DecodeError, ValidationError, ...
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(f"{path} is not a valid ONNX model ({first})") from err
    return model


def bind_shapes(model, specs: Sequence[str]) -> Tuple[object, List[str]]:
    """`model` with static input shapes (`--input-shape` specs, dynamic dimensions otherwise
    1) and the lines that say which dimensions were bound to what."""
    from ..cli import UserError
    from ..models import bind_input_shapes, input_shapes, parse_input_shapes

    try:
        given = parse_input_shapes(specs)
        bound_model, bound = bind_input_shapes(model, given)
    except ValueError as err:
        raise UserError(f"--input-shape: {err}") from None
    lines = []
    shapes = input_shapes(bound_model)
    for name, dims in bound.items():
        how = "as given" if name in given else "by default; --input-shape to change"
        lines.append(f"input {name}: {'x'.join(map(str, shapes[name]))}, dynamic dimensions "
                     f"bound {how}: {', '.join(f'{d}={v}' for d, v in dims.items())}")
    return bound_model, lines


def to_relax(model, path: str):
    """The Relax module of an ONNX model, weights as constants; UserError if TVM cannot
    import it."""
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    from ..cli import UserError

    try:
        mod = from_onnx(model, keep_params_in_input=False)
    except Exception as err:
        raise UserError(f"TVM cannot import {path}: {sentence(err)}") from err
    return relax.transform.Normalize()(mod)


def load(model, path: str, specs: Sequence[str], say: Callable[[str], None] = print):
    """(model with its inputs bound, its Relax module), saying through `say` which dynamic
    dimensions were bound to what and which operators keep a dynamic shape."""
    model, bound = bind_shapes(model, specs)
    mod = to_relax(model, path)
    for line in bound:
        say(line)
    for line in dynamic_shape_notes(mod):
        say(f"note: left out of the derivation search (dynamic shape): {line}")
    return model, mod


def dynamic_shape_notes(mod) -> List[str]:
    """One line per operator the derivation search leaves alone because of a dynamic shape
    (data-dependent shapes that binding the inputs cannot make static)."""
    from ..relay_passes.subprograms import split_module

    return [f"{var}: {why}" for split in split_module(mod).values()
            for var, why in split.left_alone if "dynamic shape" in why or "symbolic" in why]


def sentence(err: BaseException) -> str:
    """An exception as a sentence: the first line of its message in words (`plain_note`), or
    its kind when it has no message."""
    text = str(err).strip()
    return plain_note(f"{type(err).__name__}: {text.splitlines()[0]}") if text else \
        type(err).__name__


# "NotImplementedError: x" or "TVMError: x" inside a note (the passes' raw exception text).
_EXCEPTION = re.compile(r"\b(?:[A-Za-z_]+\.)*([A-Z][A-Za-z]*(?:Error|Exception|NotApplicable))"
                        r": ")


def plain_note(note: str) -> str:
    """A note with exception class names turned into words ("not supported: ...")."""
    return _EXCEPTION.sub(lambda m: "not supported: " if m.group(1) == "NotImplementedError"
                          else "", note)
