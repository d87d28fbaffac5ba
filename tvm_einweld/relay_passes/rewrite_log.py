"""`RewriteLog`: a PassContext instrument that logs every rewrite `DerivationTransform` makes.

TVM's `PassContext` accepts only configuration keys registered in C++, so a Python plugin
cannot add a `config={...}` option; instruments are the context's other, Python-extensible
slot, and they see every pass run inside the context, also passes nested in a pipeline:

    with tvm.transform.PassContext(instruments=[RewriteLog("rewrites.jsonl")]):
        ex = tvm.compile(mod, "llvm", relax_pipeline="einweld")

While a `DerivationTransform` runs, the instrument is registered as a sink; the pass hands it
one JSON record per subprogram (operators, chosen program, rule sequence, verification
evidence, estimated and measured times) which it keeps in `records` and, with a path, appends
to that file as JSON lines.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional, Sequence, Union

import tvm

PASS_NAME = "DerivationTransform"
_ACTIVE: List["RewriteLog"] = []


@tvm.instrument.pass_instrument
class RewriteLog:
    """Collects DerivationTransform's per-subprogram records (see the module docstring)."""

    def __init__(self, path: Union[None, str, Path] = None) -> None:
        self.path = None if path is None else Path(path)
        self.records: List[dict] = []

    def run_before_pass(self, mod, info) -> None:
        if info.name == PASS_NAME and self not in _ACTIVE:
            _ACTIVE.append(self)

    def run_after_pass(self, mod, info) -> None:
        if info.name == PASS_NAME:
            self._leave()

    def exit_pass_ctx(self) -> None:
        self._leave()  # also when the pass raised and run_after_pass never came

    def _leave(self) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def write(self, records: Sequence[dict]) -> None:
        self.records.extend(records)
        if self.path is not None:
            append_json_lines(self.path, records)


def active_logs() -> List[RewriteLog]:
    """The RewriteLog instruments of the running DerivationTransform's PassContext."""
    return list(_ACTIVE)


def append_json_lines(path: Union[str, Path], records: Sequence[dict]) -> None:
    with open(path, "a") as fh:
        for rec in records:
            fh.write(json.dumps(rec) + "\n")


def write_records(records: Sequence[dict], log: Optional[Union[str, Path, list]]) -> None:
    """Hand `records` to the pass's own `log` argument (a path or a list) and to every active
    RewriteLog instrument."""
    if isinstance(log, list):
        log.extend(records)
    elif log is not None:
        append_json_lines(log, records)
    for sink in active_logs():
        sink.write(records)
