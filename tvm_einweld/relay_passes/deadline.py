"""The search's wall-clock deadline, for helpers that can run long inside one rule.

The search checks its time limit between states; one rule's proposals (an inverse fitted over
a large modulus, say) can take minutes. Such helpers call `check_deadline()`, which raises
`DeadlineExceeded` once the deadline of the enclosing `search_deadline` block has passed; the
search then stops proposing and ends with stopped_by "time_limit".
"""
from __future__ import annotations

import contextlib
import contextvars
import time
from typing import Iterator

_DEADLINE: contextvars.ContextVar = contextvars.ContextVar("einweld_search_deadline",
                                                          default=None)


class DeadlineExceeded(Exception):
    """The enclosing search's time limit has passed."""


@contextlib.contextmanager
def search_deadline(at: float) -> Iterator[None]:
    """Within the block, `check_deadline()` raises after `time.perf_counter()` passes `at`."""
    token = _DEADLINE.set(at)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def check_deadline() -> None:
    at = _DEADLINE.get()
    if at is not None and time.perf_counter() > at:
        raise DeadlineExceeded("search time limit reached")
