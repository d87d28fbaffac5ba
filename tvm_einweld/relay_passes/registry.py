"""The derivation rules of the package, in one table.

`RULES` lists every intra-expression rule class (each a `derivation.Rule`). What the search
does with a rule is declared on the rule itself, not here nor in the search: `searched` (the
default search applies it) and `explorative_only` (converging derivation leaves it out). So
`default_rules()`, the package exports and the documentation all read one list, and a new
rule is added in one place.

The order is the order the search proposes in before its seeded shuffle, so it is part of what
makes a search reproducible: append, do not reorder.

The inter-expression rule objects (`ExpressionMerging`, `ExpressionFusion`) read two
expressions, not one; they are not `Rule`s and the search does not apply them.
"""
from __future__ import annotations

from typing import List, Tuple, Type

from .boundary import BoundaryRelaxing, BoundaryTightening
from .derivation import Rule
from .inter_expression import ExpressionSplitting
from .summation_splitting import SummationSplitting
from .traversal_merging import TraversalMerging
from .variable_substitution import SummationIteratorSplitting, VariableSubstitution
from .window_splitting import WindowSplitting

RULES: Tuple[Type[Rule], ...] = (
    SummationSplitting, VariableSubstitution, SummationIteratorSplitting, TraversalMerging,
    BoundaryRelaxing, BoundaryTightening, ExpressionSplitting, WindowSplitting,
)


def default_rules() -> List[Rule]:
    """One instance, with default options, of every rule in `RULES` marked `searched`."""
    return [rule() for rule in RULES if rule.searched]


__all__ = ["RULES", "default_rules"]
