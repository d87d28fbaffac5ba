"""The three static-data layout strategies (AL-Ansor §2.3) as MetaSchedule programs.

Every sampled candidate is a program A of the task (no layout rewrite). From it we derive:

* P   -- A after MetaSchedule's ``RewriteLayout`` postproc. Its layout transform blocks carry
         ``meta_schedule.layout_rewrite_preproc``, so the default builder strips them
         (``RemoveWeightLayoutRewriteBlock``) and the runner feeds pre-transformed weights: the
         transform runs once at compile time (strategy LC). In Relax the same blocks are split
         out by ``SplitLayoutRewritePreproc`` and folded on the constant weights.
* L+P -- the same program with the transform blocks *kept* in the kernel (strategy LR): we drop
         the preproc annotation (so no builder strips them and ``ArgInfo`` keeps the original
         weight shapes), mark them with our own annotation and parallelise them, since
         ``RewriteLayout`` leaves them serial and the transform now runs at every call.

Strategy NL measures A itself. Because the three forms differ only by what is in the program,
``strategy_of`` can tell them apart from the program alone; the feature extractor and the
database resume path use that instead of side tables.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import tvm
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms

PREPROC_ANN = "meta_schedule.layout_rewrite_preproc"
IN_KERNEL_ANN = "einweld.layout_transform_in_kernel"
STRATEGY_ATTR = "einweld.layout_strategy"

# Below this many elements a parallel launch costs more than the serial copy it would split.
MIN_PARALLEL_COPY_ELEMS = 4096


class Strategy(enum.Enum):
    """A static-data layout strategy: what is measured and what the cost model learns from."""

    NL = "NL"  # no layout rewrite: measure A
    LR = "LR"  # layout transform at run time: measure L+P
    LC = "LC"  # layout transform at compile time: measure P

    @staticmethod
    def parse(text: str) -> "Strategy":
        try:
            return Strategy(text.upper())
        except ValueError:
            raise ValueError(f"unknown layout strategy {text!r}; expected NL, LR or LC") from None


@dataclass(frozen=True)
class LayoutPrograms:
    """The programs derived from one sampled candidate A."""

    no_layout: s_tir.Schedule  # A
    run_time: s_tir.Schedule  # L+P
    compile_time: s_tir.Schedule  # P
    rewritten: bool  # False when the task has no layout-free buffer to rewrite

    def for_strategy(self, strategy: Strategy) -> s_tir.Schedule:
        return {
            Strategy.NL: self.no_layout,
            Strategy.LR: self.run_time,
            Strategy.LC: self.compile_time,
        }[strategy]


def _root_blocks(sch: s_tir.Schedule):
    return sch.get_child_blocks(sch.get_sblock("root"))


def _annotated(sch: s_tir.Schedule, key: str):
    return [b for b in _root_blocks(sch) if key in sch.get(b).annotations]


def derive_programs(candidate: s_tir.Schedule) -> LayoutPrograms:
    """Derive P and L+P from a sampled program A (the candidate is not modified)."""
    p = candidate.copy()
    ms.postproc.RewriteLayout().apply(p)
    rewritten = bool(_annotated(p, PREPROC_ANN))
    lr = p.copy()
    for block in _annotated(lr, PREPROC_ANN):
        lr.unannotate(block, PREPROC_ANN)
        lr.annotate(block, IN_KERNEL_ANN, 1)
        loops = lr.get_loops(block)
        extent = 1
        for loop in loops:
            extent *= int(lr.get(loop).extent)
        if extent >= MIN_PARALLEL_COPY_ELEMS:
            lr.parallel(lr.fuse(*loops))
    return LayoutPrograms(candidate, lr, p, rewritten)


def strategy_of(sch: s_tir.Schedule) -> Strategy:
    """Which strategy's program this is, read from the program itself."""
    if _annotated(sch, PREPROC_ANN):
        return Strategy.LC
    if _annotated(sch, IN_KERNEL_ANN):
        return Strategy.LR
    return Strategy.NL


def tagged_workload(mod: tvm.IRModule, tag: "Strategy | str") -> tvm.IRModule:
    """The task module tagged with a strategy (or "rejected"): a distinct database workload (its
    hash differs), so records of programs that are not deployed never shadow deployed ones."""
    gv = mod.get_global_var("main")
    func = mod["main"].with_attr(STRATEGY_ATTR, tag.value if isinstance(tag, Strategy) else tag)
    return tvm.IRModule({gv: func})


def args_info(sch: s_tir.Schedule) -> list:
    """Argument shapes the runner feeds: P gets its rewritten weights, A and L+P the originals."""
    return ms.arg_info.ArgInfo.from_entry_func(sch.mod, remove_preproc=True)
