"""Tensor-algebra expression IR (EinNet §3).

    from tvm_einweld.expr import Tensor, Iterator, Expr, evaluate
    A, K = Tensor("A", (1, 64, 56, 56)), Tensor("K", (64, 64, 3, 3))
    e = canonical.conv2d(A, K, padding=(1, 1, 1, 1))
    print(e)            # L{n:0..1, f:0..64, ...} Σ{c:0..64, r:0..3, s:0..3} A[...] * K[...]
    evaluate(e, {"A": a, "K": k})

Modules: `index` (index functions), `expression` (iterators, tensors, scopes, bodies),
`interpreter` (exact numpy evaluation), `canonical` (operators as expressions),
`lowering` (to TE/TIR), `fingerprint` (search-state hashing and structural equality),
`from_relax` (Relax calls to canonical expressions), `index_simplify` (floor-div/mod aware
simplification of index functions under iterator ranges).
"""
from .expression import (
    Access, BinaryOp, Constant, Expr, Iterator, Scalar, Scope, Tensor, UnaryOp, describe,
    input_tensors, unary,
)
from .index import IBin, IConst, IndexExpr, IVar
from .interpreter import EvaluationError, evaluate, random_inputs

__all__ = [
    "Access", "BinaryOp", "Constant", "Expr", "Iterator", "Scalar", "Scope", "Tensor", "UnaryOp",
    "describe", "input_tensors", "unary", "IBin", "IConst", "IndexExpr", "IVar",
    "EvaluationError", "evaluate", "random_inputs",
]
