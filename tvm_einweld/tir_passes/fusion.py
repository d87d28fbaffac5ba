"""TileGraphFusion: the Relax module pass that applies tile-graph scheduling end to end.

Input: a Relax module whose `main` calls PrimFuncs with `call_tir` (after `LegalizeOps`, and
optionally stock `AnnotateTIROpPattern` + `FuseOps` + `FuseTIR`; see `prepare()`).
Output: the same module in which every group chosen by `graph_connecting` is one `call_tir` of a
fused, tiled kernel whose connected intermediates live in tile buffers (CPU scratch / CUDA shared
memory), and every node left alone but tileable is replaced by its tiled kernel, but a GEMM-class
node on a GPU, which keeps its call for DLight's matmul (`gpu_matmul`).

Why it is correct: a group is replaced only after its kernel computed the same output as the
group's original PrimFuncs (TVM's own build) on random inputs (`measure.check_group`); a group
whose kernel cannot be generated or fails that check keeps its original calls, and a warning
says why. The module the pass returns is then run as a whole against the module it was given
(`verify.module_check`; or against `reference`, a module computing the same, see
`TileGraphFusion`); if they disagree the given module is returned, with a warning. The replacement call sits where the group's last node was and reads the same tensors;
intermediates it removes were read by no one outside the group (see `tile_graph.subgraph`).
On a CUDA target, which cannot run here, the check runs the CUDA kernel's own TIR on the CPU, its
thread loops one after another and its buffers between guard zones (`codegen.serial_threads`),
and tile configurations are chosen by the cost model instead of by measurement; and
every CUDA tile kernel is checked as it will be emitted before it is even a candidate
(`codegen.cuda_kernel_problem`: well formed, lowered and built by TVM, its shared memory
counted exactly on the lowered kernel and held to the device's limits). A tile whose kernel
fails that check is never used: the scheduler takes the next-ranked tile that passes, or
leaves the group unfused; `FusionReport.refused` says which kernel failed and why.
A multi-node group that fails is retried node by node, so its operators are still tiled.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import tvm
from tvm import ir, relax, tirx

from .codegen import (Unsupported, block_sub_tiles, cuda_kernel_problem, group_prim_func,
                      schedule_group, serial_threads)
from .cost import TileConfig, intermediate_bytes, propagate_subgraph
from .device import Device, device_for_target
from .localize import LocalizeError
from .rules import is_scheduled, scheduled_kernel
from .rules.cpu.fast_math import rewrite_fast_math
from .measure import (CheckResult, check_group, check_parts, time_alone, time_alone_all,
                      time_kernel)
from .scheduler import (Candidate, GraphPlan, estimated_seconds, graph_connecting,
                        subgraph_tiling)
from .tile_graph import SubGraph, TileGraph, build_tile_graph, subgraph

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FusionReport:
    """What the last run of the pass did (kept on the pass object for benchmarks and tests)."""

    plan: GraphPlan
    replaced: tuple[tuple[str, ...], ...]
    rejected: tuple[tuple[tuple[str, ...], str], ...]
    measurements: int = 0  # kernels built and timed on the target while scheduling
    # single nodes left to the analytic CPU rules (their kernel beat every tile config), or
    # on a GPU lone GEMM-class nodes left to DLight's matmul (`gpu_matmul`)
    analytic: tuple[str, ...] = ()
    # (tile kernel, the group's merged function before tiling) for every tile kernel: what a
    # tuner searches instead of the tile schedule (`auto_scheduler_ext.kernel_tuning`)
    unscheduled: tuple[tuple[tirx.PrimFunc, tirx.PrimFunc], ...] = ()
    # (group's node names, tile, why) for every CUDA tile kernel that failed the check of
    # what is emitted (`codegen.cuda_kernel_problem`) and so was not a candidate
    refused: tuple[tuple[tuple[str, ...], tuple[int, ...], str], ...] = ()


def prepare() -> tvm.transform.Pass:
    """The passes that turn a Relax model into the input TileGraphFusion expects: stock
    legalisation and fusion, after strided transposed convolutions are split into their
    stride-1 phases (`relay_passes.conv_transpose_phases`: no multiply-adds of the zeros a
    dilated input would hold) and reshapes, transposes and gathers of constants are folded
    with numpy (`relay_passes.fold_data_movement`: FoldConstant compiles each one); an
    operand a contraction gathers (by an index) is read through the index in the
    contraction's kernel (`relay_passes.gather_contraction`); softmax is legalised with one
    reciprocal per row (`legalize`). The derivation pass costs operators through this too."""
    from ..relay_passes.conv_transpose_phases import ConvTransposePhases
    from ..relay_passes.fold_data_movement import FoldDataMovement
    from ..relay_passes.gather_contraction import FuseGatherIntoContraction
    from .legalize import legalize_ops

    return tvm.transform.Sequential([
        ConvTransposePhases,
        FoldDataMovement,
        legalize_ops(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        FuseGatherIntoContraction,
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(),
    ])


def analytic_pipeline(target) -> tvm.transform.Pass:
    """How the einweld pipeline builds a kernel that no tile group takes: prepare(), the
    analytic CPU schedule rules with compile-time weight packing (llvm), then TVM's lowering (on GPU targets, TVM's default
    pipeline). Candidates are timed with it, so they are costed on the kernels that will run."""
    from .rules.cpu.apply import prepack_weights

    target = tvm.target.Target(target) if isinstance(target, (str, dict)) else target
    if target.kind.name != "llvm":
        return relax.get_default_pipeline(target)
    return tvm.transform.Sequential([prepare(), prepack_weights(target),
                                     relax.pipeline.default_build_pipeline()],
                                    name="einweld_kernels")


def pipeline(target, topk: int = 4) -> tvm.transform.Pass:
    """prepare() then TileGraphFusion: Relax in, Relax with fused tile kernels out."""
    return tvm.transform.Sequential([prepare(), TileGraphFusion(target, topk=topk)],
                                    name="tile_graph_fusion")


def compile_pipeline(target, topk: int = 4) -> tvm.transform.Pass:
    """A complete `relax_pipeline` for tvm.compile: `pipeline()`, then what tvm.compile's default
    does for the target (on CUDA its DLight schedules cover the kernels left unfused)."""
    target = tvm.target.Target(target) if isinstance(target, (str, dict)) else target
    rest = (relax.get_default_pipeline(target) if "gpu" in target.keys
            else relax.pipeline.default_build_pipeline())
    return tvm.transform.Sequential([pipeline(target, topk), rest], name="tile_graph_compile")


class KernelFactory:
    """Generates (and caches) the tiled kernel of a group for one device.

    On a CUDA device, with the `target` given, a kernel is returned only when
    `codegen.cuda_kernel_problem` finds nothing wrong with it as emitted for that target; the
    kernels it refused are in `refused` ((node names, tile) -> why)."""

    def __init__(self, graph: TileGraph, device: Device, check_plan: bool = True,
                 target=None):
        self.graph = graph
        self.device = device
        self.check_plan = check_plan
        self.target = target
        self.refused: dict = {}
        self._merged: dict = {}
        self._kernels: dict = {}

    def merged(self, sub: SubGraph) -> tirx.PrimFunc:
        if sub.names not in self._merged:
            self._merged[sub.names] = group_prim_func(self.graph, sub)
        return self._merged[sub.names]

    def _planned_bytes(self, sub: SubGraph, config: TileConfig) -> int | None:
        """What the kernel's tile buffers may use: the plan's tiles on CPU; on CUDA no bound
        here: TVM's lowering still changes the buffers (its StorageRewrite shares dead ones,
        its region compaction may widen one), so they are counted after it, exactly
        (`codegen.cuda_kernel_problem`)."""
        if self.device.kind == "cuda":
            return None
        return intermediate_bytes(self.graph, sub, propagate_subgraph(self.graph, sub, config))

    def kernel(self, sub: SubGraph, config: TileConfig, inner=()) -> tirx.PrimFunc | None:
        """The kernel of `sub` tiled by `config`, with the upper-level sub-tiles `inner`
        (`Candidate.inner`); None when it cannot be generated (or, on CUDA, fails its check).
        Sub-tiles the schedule primitives reject, or whose kernel fails the check, are
        dropped (the kernel of the fuse-level tile alone is tried)."""
        key = (sub.names, config.tile, tuple((t.node, t.config.tile) for t in inner))
        if key not in self._kernels:
            self._kernels[key] = self._generate(sub, config, inner)
        return self._kernels[key]

    def _generate(self, sub: SubGraph, config: TileConfig, inner) -> tirx.PrimFunc | None:
        try:
            merged = self.merged(sub)
            sub_tiles = block_sub_tiles(self.graph, sub, merged, config, inner)
        except (Unsupported, ValueError) as err:
            logger.info("group %s not merged: %s", sorted(sub.names), err)
            return None
        func, problem = self._schedule(sub, merged, config, sub_tiles)
        if func is None and sub_tiles:
            func, retry_problem = self._schedule(sub, merged, config, {})
            problem = retry_problem or problem  # keep the first attempt's reason if none new
        names, tile = tuple(n.name for n in sub.nodes), tuple(int(t) for t in config.tile)
        if func is None and problem is not None:
            self.refused[(names, tile)] = problem
            logger.info("group %s tile %s not used: %s", list(names), tile, problem)
        elif func is not None:
            self.refused.pop((names, tile), None)  # refused with other sub-tiles only
        return func

    def _schedule(self, sub, merged, config, sub_tiles):
        """(kernel, None), or (None, why the CUDA check refused it), or (None, None) when the
        schedule cannot be generated at all."""
        try:
            planned = self._planned_bytes(sub, config) if self.check_plan else None
            func = scheduled_kernel(schedule_group(merged, config.tile, self.device, planned,
                                                   sub_tiles))
        except (Unsupported, LocalizeError) as err:
            logger.info("group %s tile %s sub-tiles %s not generated: %s", sorted(sub.names),
                        config.tile, sub_tiles, err)
            return None, None
        except Exception as err:  # pylint: disable=broad-except
            # A defect of the code generator on this group (a case it did not foresee, such
            # as the tile-dependent extent CSRNet met on a 2 MiB-L2 Xeon) costs this candidate
            # only: the group is left to its other tiles or unfused, never the compile.
            logger.warning("group %s tile %s: code generation failed (%s: %s); not used",
                           sorted(sub.names), tuple(int(t) for t in config.tile),
                           type(err).__name__, err)
            return None, None
        if self.device.kind == "cpu":
            # As the CPU rules' kernels: vectorisable exp/erf/tanh/sigmoid (libm's are
            # scalar calls, one per lane), divisions by constants and lane-invariant values
            # as products (`fast_math`; the group check runs the kernel as rewritten).
            func = rewrite_fast_math(func, self.target)[0]
        if self.device.kind == "cuda" and self.target is not None:
            problem = cuda_kernel_problem(func, self.target, self.device)
            if problem is not None:
                return None, problem
        return func, None

    def usable(self, sub: SubGraph, cand: Candidate) -> bool:
        """Whether `cand`'s kernel can be generated (and, on CUDA, passed its check)."""
        return self.kernel(sub, cand.config, cand.inner) is not None


@tvm.transform.module_pass(opt_level=0, name="TileGraphFusion")
class TileGraphFusion:
    """Welder's tile-graph scheduling as a Relax module pass (see the module docstring).

    Instances are `tvm.ir.transform.Pass` objects; after a run, `.report` says what was fused.

    Parameters: `target` (llvm or cuda), `topk` tile configs measured per group, `measure`
    (default: True when the target is the CPU this runs on), `verify` (check each group on random
    inputs before replacing it; on by default, and only turn it off in benchmarks that re-check),
    `reference`: a module computing what the pass's input computes, with the same parameters
    (the einweld pipeline passes the module it gave `prepare()`, already built and run by the
    check of the stage before): the fused module is checked whole against it instead of
    against the input, which is then neither built nor run once more; `check_whole=False`
    leaves the whole-module check to the caller (the einweld pipeline checks its final module).
    """

    def __init__(self, target, topk: int = 4, measure: bool | None = None, verify: bool = True,
                 device: Device | None = None, rules: bool = True,
                 reference: ir.IRModule | None = None, check_whole: bool = True):
        self.target = tvm.target.Target(target) if isinstance(target, (str, dict)) else target
        self.device = device or device_for_target(self.target)
        self.topk = topk
        self.measure = (self.device.kind == "cpu") if measure is None else measure
        self.verify = verify
        self.rules = rules and self.target.kind.name == "llvm"
        self.reference = reference
        self.check_whole = check_whole
        self.report: FusionReport | None = None
        self.checks: list = []  # the whole-module check of the last run (verify.module_check)
        self._measured = 0
        self._claims: dict = {}  # node names -> what the analytic rules give their kernel

    def transform_module(self, mod: ir.IRModule, _ctx) -> ir.IRModule:
        from ..verify.module_check import checked

        self.checks = []
        fused = self._fuse(mod)
        if not (self.verify and self.check_whole) or fused is mod:
            return fused
        # Equal to the reference means equal to what the input computes (see __init__); a
        # disagreement falls back to the input itself.
        reference = self.reference if self.reference is not None else mod
        return fused if checked("TileGraphFusion", reference, fused, self.target,
                                self.checks) is fused else mod

    def _fuse(self, mod: ir.IRModule) -> ir.IRModule:
        graph = build_tile_graph(mod, "main")
        if not graph.nodes:
            return mod
        factory = KernelFactory(graph, self.device, target=self.target)
        accept = factory.usable if self.device.kind == "cuda" else None
        self._measured, self._claims = 0, {}
        wanted: dict = {}

        def tiles_wanted(sub: SubGraph) -> bool:
            if sub.names not in wanted:
                wanted[sub.names] = self._tile_configs_wanted(sub, factory)
            return wanted[sub.names]

        plan = graph_connecting(graph, self.device, self.topk,
                                self._evaluator(graph, factory, tiles_wanted),
                                self._alone(graph, factory) if self.rules else None,
                                tiles_wanted,
                                lambda sub: self._analytic(sub, factory) is not None,
                                self._prefetch(graph, factory) if self.rules else None,
                                accept)
        replacements, rejected = [], []
        # A group whose best kernel is the analytic one (candidate None) is replaced by its
        # merged, unscheduled function, which the analytic rules schedule later exactly as
        # `time_alone` timed it; a single node left to them keeps its own call.
        # On a GPU a lone GEMM-class node keeps its call for DLight's matmul (`gpu_matmul`).
        peer = {id(g) for g in plan.groups if g.candidate is None or
                (len(g.sub.nodes) == 1 and gpu_matmul(g.sub.nodes[0].func, self.target))}
        pending = [(g.sub, g.candidate) for g in plan.groups
                   if id(g) not in peer or len(g.sub.nodes) > 1]
        analytic = tuple("+".join(n.name for n in g.sub.nodes) for g in plan.groups
                         if id(g) in peer)
        while pending:
            sub, cand = pending.pop(0)
            names = tuple(n.name for n in sub.nodes)
            func = factory.kernel(sub, cand.config, cand.inner) if cand is not None else \
                factory.merged(sub)
            result = None
            if func is None:
                why = factory.refused.get((names, tuple(cand.config.tile))) if cand else None
                result = CheckResult(False, float("inf"), why or "kernel could not be generated")
            elif self.verify:
                result = self._check(graph, sub, cand, func)
            if result is not None and not result.ok:
                logger.warning("TileGraphFusion leaves %s unfused: %s", names, result.message)
                rejected.append((names, result.message))
                if len(sub.nodes) > 1 and cand is not None:  # its nodes may still be tiled
                    pending.extend(self._singles(graph, sub, accept))
                continue
            replacements.append((sub, func))
        unscheduled = tuple((func, factory.merged(sub)) for sub, func in replacements
                            if is_scheduled(func))
        self.report = FusionReport(plan, tuple(tuple(n.name for n in s.nodes)
                                               for s, _ in replacements), tuple(rejected),
                                   self._measured, analytic, unscheduled,
                                   tuple((names, tile, why) for (names, tile), why
                                         in factory.refused.items()))
        return replace_groups(mod, graph, replacements)

    def _singles(self, graph, sub, accept=None):
        """(single-node sub-graph, its best candidate by the model that `accept`s) for each
        node of `sub` but a GEMM-class node on a GPU (`gpu_matmul`)."""
        out = []
        for node in sub.nodes:
            if gpu_matmul(node.func, self.target):
                continue  # keeps its call, for DLight
            single = subgraph(graph, [node.name])
            cands = subgraph_tiling(graph, single, self.device, 1, accept=accept)
            if cands:
                out.append((single, cands[0]))
        return out

    def _alone(self, graph, factory):
        """Seconds of a sub-graph's analytic kernel (`rules.cpu.schedule_cpu` on a single
        node's function or on a group's merged one; constant weights packed at compile time:
        `measure.time_alone`), or None when no rule claims it or it cannot be timed. Without
        measurement, the model's own terms: the sub-graph's compulsory traffic (its inputs and
        output once) at DRAM bandwidth, the ideal a tile config's penalised traffic is held
        against."""

        def alone(sub: SubGraph):
            single = len(sub.nodes) == 1
            if self._analytic(sub, factory) is None:
                return None
            func = None if single else factory.merged(sub)
            if not self.measure:
                inputs = sub.nodes[0].inputs if single else sub.inputs
                moved = sum(graph.tensors[t].nbytes for t in (*inputs, sub.output))
                return moved / self.device.level(0).bandwidth
            self._measured += 1
            try:
                return time_alone(graph, sub, self.target, func)
            except Exception as err:  # pylint: disable=broad-except  # unbuildable = unusable
                logger.info("analytic kernel of %s did not build: %s", sub.names, err)
                return None

        return alone

    def _prefetch(self, graph, factory):
        """Times the analytic kernels of several sub-graphs at once (`measure.time_alone_all`:
        built together, code generation in parallel), for `_alone` to find cached."""

        def prefetch(subs) -> None:
            if not self.measure or len(subs) < 2:
                return
            try:
                time_alone_all(graph, [(sub, None if len(sub.nodes) == 1 else
                                        factory.merged(sub)) for sub in subs], self.target)
            except Exception as err:  # pylint: disable=broad-except  # `_alone` retries each
                logger.info("kernels of %s not built together: %s",
                            [sorted(sub.names) for sub in subs], err)

        return prefetch

    def _claim(self, names: frozenset, func_of):
        """(rule family, scheduled function) that `rules.cpu.schedule_cpu` gives the kernel
        of the nodes `names` (`func_of()` builds it), or None when no rule claims it or the
        group cannot be merged; computed once per run (pricing, pruning and checking a group
        all ask)."""
        from .rules.cpu import schedule_cpu

        if names not in self._claims:
            try:
                func = func_of()
            except (Unsupported, ValueError):
                self._claims[names] = None
            else:
                self._claims[names] = schedule_cpu(func, self.target)
        return self._claims[names]

    def _analytic(self, sub: SubGraph, factory):
        """`_claim` of a sub-graph: a single node's own function or a group's merged one."""
        return self._claim(sub.names, lambda: sub.nodes[0].func if len(sub.nodes) == 1
                           else factory.merged(sub))

    def _family(self, node) -> str | None:
        """The analytic rule family ("conv", "gemm", "memory-bound") claiming a node's own
        function, or None."""
        claim = self._claim(frozenset([node.name]), lambda: node.func)
        return claim[0] if claim else None

    def _tile_configs_wanted(self, sub: SubGraph, factory) -> bool:
        """Whether tile configs of `sub` are worth building and timing. Not when `sub` holds a
        convolution or GEMM-class node the analytic rules schedule and either stands alone,
        holds a second one, or forms a group the rules also schedule as one (a GEMM with its
        prologue/epilogue): the tile code generator has no register blocking, and its conv /
        GEMM kernels measured 2-10x slower than the analytic ones (ResNet-18, BERT), so timing
        them only cost compile time and, under load, let noise pick a slow kernel. Tile
        configs stay for one contraction with memory-bound neighbours the rules cannot merge
        (a GEMM followed by softmax or layer norm: Welder's case) and for memory-bound groups."""
        if not self.rules:
            return True
        contractions = sum(self._family(n) in ("conv", "gemm") for n in sub.nodes)
        if contractions == 0:
            return True
        if contractions > 1 or len(sub.nodes) == 1:
            return False
        return self._analytic(sub, factory) is None

    def _evaluator(self, graph, factory, tiles_wanted):
        """Seconds of a candidate: measured, or estimated once its kernel is known to build;
        None (not a candidate) where tile configs are not wanted (`tiles_wanted`, memoised
        `_tile_configs_wanted`)."""

        def evaluate(sub: SubGraph, cand: Candidate):
            if not tiles_wanted(sub):
                return None
            func = factory.kernel(sub, cand.config, cand.inner)
            if func is None:
                return None
            if not self.measure:
                return estimated_seconds(cand.cost, self.device)
            self._measured += 1
            try:
                return time_kernel(func, graph, sub, self.target)
            except Exception as err:  # pylint: disable=broad-except  # unbuildable = unusable
                logger.info("group %s did not build: %s", sorted(sub.names), err)
                return None

        return evaluate

    def _check(self, graph, sub, cand, func):
        if cand is None:  # a merged group for the analytic rules: check it as they schedule it
            scheduled = self._claim(sub.names, lambda: func)
            return check_group(scheduled[1] if scheduled else func, graph, sub, self.target)
        if self.target.kind.name == "llvm":
            return check_group(func, graph, sub, self.target)
        # The CUDA kernel itself on this CPU, its thread loops run one after another, its even
        # and its odd blocks apart (`codegen.serial_threads`, `measure.check_parts`): its
        # index arithmetic, predicates and tile buffers are checked, and a write outside a
        # buffer or into the tile of a block an odd number of blocks away is caught
        # (FSRCNN's unguarded write-backs, wrong on an H200, were; a write an even distance
        # away lands in the same part and is not). A plan's CPU twin, which this replaces,
        # shared none of it.
        parts = [serial_threads(func, (2, offset)) for offset in (0, 1)]
        return check_parts(parts, graph, sub)


def gpu_matmul(func: tirx.PrimFunc, target: tvm.target.Target) -> bool:
    """Whether `target` is a GPU and TVM's own GPU matmul rule (`dlight.gpu.Matmul`: shared
    memory and register tiling, vectorised loads; what TVM's default CUDA pipeline gives the
    kernel) claims `func`. Such a node left alone by the plan keeps its call, for that rule:
    a single-node tile kernel keeps no intermediate in shared memory, so the Welder code
    generator only competes with DLight as a GEMM kernel, which it is not (no register
    blocking of its own beyond one sub-tile per thread). NeRF's GEMMs as single-node tile
    kernels (64 x 64 tiles) took 3.69 ms on an H200 against 0.33 ms for TVM's build
    (benchmarks/cuda_device_check.md, run 3). The plan still prices the node by its best
    tile, so its joins with neighbours are weighed as before."""
    if "gpu" not in target.keys:
        return False
    from tvm.s_tir import dlight as dl

    try:
        with target:
            return dl.gpu.Matmul().apply(func.with_attr("global_symbol", "main"), target,
                                         False) is not None
    except Exception:  # pylint: disable=broad-except  # a rule that fails claims nothing
        return False


def replace_groups(mod: ir.IRModule, graph: TileGraph, replacements) -> ir.IRModule:
    """Replace each (SubGraph, PrimFunc) group of `mod["main"]` by one call_tir of the func."""
    if not replacements:
        return mod
    main = mod["main"]
    bb = relax.BlockBuilder(mod)
    dropped, sinks = set(), {}
    for sub, func in replacements:
        name = "tile_" + "_".join(n.gvar.name_hint for n in sub.nodes)[:60]
        gvar = bb.add_func(func, name)  # unique name, typed GlobalVar
        for node in sub.nodes[:-1]:
            dropped.add(graph.exprs[node.output])
        out = graph.tensors[sub.output]
        args = [graph.exprs[t] for t in sub.inputs]
        sinks[graph.exprs[sub.output]] = relax.call_tir(
            gvar, args, relax.TensorType(out.shape, out.dtype))
    blocks = []
    for block in main.body.blocks:
        bindings = []
        for binding in block.bindings:
            if binding.var in dropped:
                continue
            if binding.var in sinks:
                binding = relax.VarBinding(binding.var, sinks[binding.var])
            bindings.append(binding)
        blocks.append(type(block)(bindings))
    body = relax.SeqExpr(blocks, main.body.body)
    bb.update_func(mod.get_global_var("main"),
                   relax.Function(main.params, body, main.ret_ty, main.is_pure, main.attrs))
    return relax.transform.DeadCodeElimination(["main"])(bb.get())
