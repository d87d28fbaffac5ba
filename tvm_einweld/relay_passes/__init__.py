"""Graph-level derivations (EinNet §4–§5) over `tvm_einweld.expr` expressions.

    from tvm_einweld.relay_passes import SummationSplitting, apply_at, instantiate, build
    d = apply_at(SummationSplitting(inner={"c"}), conv_expr)   # proven rule instance
    program = instantiate(d.result)                            # Relax module (BlockBuilder)

Modules, one idea each:
  derivation             Derivation / Rule (what every rule declares) / apply_at; rule
                         locations (top level, scopes)
  registry               RULES, every intra-expression rule; default_rules, the searched ones
  summation_splitting    Σ_{s1,s2} → Σ_{s1} {Σ_{s2}}
  variable_substitution  y = Φ(x) with proven inverse ψ (offsets, coupled pairs, merges,
                         splits), and splitting of summation iterators
  inverse                fitting ψ from sample points (then proven)
  traversal_merging      inline a scope (Φ(X×Y) ⊆ Z proven; its padding moves onto tensors)
  boundary               relaxing and tightening of ranges (zero slabs proven)
  window_splitting       a sliding window as offsets of a smaller one (relax + split + scope;
                         conv 5×5 → conv 3×3 with 4× the channels + OffsetReduce)
  inter_expression       expression splitting, merging, fusion (and rule objects for them)
  mapping_table          iterator-mapping table, operator matching, expression_distance
  eoperator              eOperators as scheduled TE kernels
  instantiate            expressions → Relax (matmul, conv2d, G2BMM kernel, eOperators)
  cases                  the paper's motivating derivations as fixed rule sequences
  search                 distance-guided derivation search (explorative + converging)
  op_cost                costs of candidates (timed operators, eOperators by traffic),
                         FLOPs and bytes of expressions and kernels (the intensity and
                         memory-bound test themselves: `cost_model`)
  candidates             candidate programs: emitters, subprogram modules, result types
  derivation_transform   DerivationTransform, the Relax module pass (Algorithm 1)
  rewrite_log            RewriteLog, a PassContext instrument logging every rewrite as JSON
  conv_transpose_phases  ConvTransposePhases: a strided conv-transpose as stride² stride-1
                         convolutions (its phases), interleaved; run before legalisation
  gather_contraction     FuseGatherIntoContraction: a gather kernel whose only user is a
                         contraction is fused into it (read through its index, not
                         materialised); run after FuseOps
  output_buffers         BindOutputs: `main` writes its results into buffers the caller
                         passes (destination passing, onnxruntime's IO binding)
"""
from .boundary import BoundaryRelaxing, BoundaryTightening
from .derivation import (
    Derivation, LevelRewrite, Proposal, Rule, RuleNotApplicable, apply_at, check, locations,
)
from .inter_expression import (
    ExpressionFusion, ExpressionMerging, ExpressionSplitting, Merged, fuse, merge_expressions,
)
from .mapping_table import TABLE, OperatorMatch, expression_distance, match
from .summation_splitting import SummationSplitting
from .traversal_merging import TraversalMerging
from .variable_substitution import SummationIteratorSplitting, VariableSubstitution, substitute
# Imported, not wrapped: a wrapper named like its submodule is replaced by the module as soon
# as `relay_passes.instantiate` is imported anywhere (Python binds submodules on the package).
from .instantiate import build, instantiate
from .window_splitting import WindowSplitting
from .registry import RULES, default_rules


def __getattr__(name):
    """`DerivationTransform` and `RewriteLog` load lazily (they import TVM)."""
    if name == "DerivationTransform":
        from .derivation_transform import DerivationTransform

        return DerivationTransform
    if name == "ConvTransposePhases":
        from .conv_transpose_phases import ConvTransposePhases

        return ConvTransposePhases
    if name == "RewriteLog":
        from .rewrite_log import RewriteLog

        return RewriteLog
    raise AttributeError(name)


__all__ = [
    "BoundaryRelaxing", "BoundaryTightening", "LevelRewrite", "Derivation", "Proposal", "Rule",
    "RuleNotApplicable", "apply_at", "check", "locations", "ExpressionFusion", "ExpressionMerging",
    "ExpressionSplitting", "Merged", "fuse",
    "merge_expressions", "TABLE", "OperatorMatch", "expression_distance", "match",
    "SummationSplitting", "TraversalMerging", "SummationIteratorSplitting",
    "VariableSubstitution", "substitute", "WindowSplitting",
    "RULES", "default_rules", "instantiate", "build", "DerivationTransform", "RewriteLog",
]
