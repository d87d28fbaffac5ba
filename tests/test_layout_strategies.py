"""NL / LR / LC programs derived from sampled candidates: numerics and what each measures."""
import numpy as np
import pytest
import tvm
from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

from tvm_einweld.auto_scheduler_ext.build_fn import build_cpu_kernel
from tvm_einweld.auto_scheduler_ext.features import StrategyFeatureExtractor
from tvm_einweld.auto_scheduler_ext.strategies import (
    IN_KERNEL_ANN,
    PREPROC_ANN,
    Strategy,
    derive_programs,
    strategy_of,
)
from tvm_einweld.auto_scheduler_ext.task_loop import _space_generator, _tune_context
from tvm_einweld.auto_scheduler_ext.workloads import Conv2dBlock
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.search_strategy import MeasureCandidate

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})
BLOCK = Conv2dBlock(1, 16, 8, 8, 16, 3, 1, 1)


def sampled_programs(block, seeds):
    """A programs as the search would measure them: a design space sample plus postprocs."""
    out = []
    for seed in seeds:
        space = _space_generator(TARGET)
        ctx = _tune_context(block.module(), TARGET, space, ms.search_strategy.EvolutionarySearch(), "t", seed, 2)
        for sch in ctx.generate_design_space():
            assert all(p.apply(sch) for p in ctx.space_generator.postprocs)
            out.append(sch)
    return out


@pytest.fixture(scope="module")
def programs():
    return [derive_programs(a) for a in sampled_programs(BLOCK, seeds=[1, 2])]


def run(rt_mod, arrays):
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for a in arrays]
    rt_mod["main"](*args)
    return args[-1].numpy()


def arg_shapes(mod):
    return [tuple(int(x) for x in info.shape) for info in ms.arg_info.ArgInfo.from_prim_func(mod["main"])]


def test_each_strategy_computes_the_block(programs):
    inputs = BLOCK.random_inputs(seed=3)
    expect = BLOCK.reference(**inputs)
    out = np.zeros(BLOCK.shapes()["out"], dtype="float32")
    for progs in programs:
        assert progs.rewritten
        for strategy in (Strategy.NL, Strategy.LR):
            got = run(build_cpu_kernel(progs.for_strategy(strategy).mod, TARGET),
                      [inputs["data"], inputs["weight"], inputs["bias"], out.copy()])
            np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-4)
        # P with its transform block still inside computes the block from original weights.
        p_full = tvm.tirx.build(progs.compile_time.mod, target=TARGET)
        got = run(p_full, [inputs["data"], inputs["weight"], inputs["bias"], out.copy()])
        np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-4)


def test_lr_measures_the_transform_and_lc_does_not(programs):
    original = BLOCK.shapes()["weight"]
    inputs = BLOCK.random_inputs(seed=4)
    out = np.zeros(BLOCK.shapes()["out"], dtype="float32")
    for progs in programs:
        built_lr = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(progs.run_time.mod)
        built_lc = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(progs.compile_time.mod)
        assert arg_shapes(built_lr)[1] == original  # L+P takes the original weights
        lc_shapes = arg_shapes(built_lc)
        rewritten = lc_shapes[1]
        assert rewritten != original  # P takes weights already transformed at compile time
        assert int(np.prod(rewritten)) == int(np.prod(original))
        # The kernels agree: LC's rejects original-layout weights, LR's accepts them.
        lc = build_cpu_kernel(progs.compile_time.mod, TARGET)
        with pytest.raises(Exception):
            run(lc, [inputs["data"], inputs["weight"], inputs["bias"], out.copy()])
        run(lc, [np.zeros(shape, "float32") for shape in lc_shapes])
        # The transform is a parallel loop inside the LR kernel.
        text = progs.run_time.mod.script()
        assert IN_KERNEL_ANN in text and PREPROC_ANN not in text and "T.parallel" in text


def test_strategy_read_from_program_and_feature(programs):
    progs = programs[0]
    assert strategy_of(progs.no_layout) is Strategy.NL
    assert strategy_of(progs.run_time) is Strategy.LR
    assert strategy_of(progs.compile_time) is Strategy.LC
    extractor = StrategyFeatureExtractor()
    ctx = _tune_context(BLOCK.module(), TARGET, _space_generator(TARGET),
                        ms.search_strategy.EvolutionarySearch(), "t", 1, 2)
    cands = [MeasureCandidate(s, ms.arg_info.ArgInfo.from_entry_func(s.mod))
             for s in (progs.no_layout, progs.run_time, progs.compile_time)]
    feats = [f.numpy() for f in extractor.extract_from(ctx, cands)]
    base = [f.numpy() for f in extractor.base.extract_from(ctx, cands)]
    # PerStoreFeature skips LC's annotated transform blocks; LR's in-kernel ones are features.
    assert base[1].shape[0] > base[2].shape[0]
    for f, b, col in zip(feats, base, (0, 1, 2)):
        np.testing.assert_array_equal(f[:, :-3], b)
        assert (f[:, -3 + col] == 1).all() and f[:, -3:].sum() == f.shape[0]
    extractor.score_as = Strategy.LC  # plain A candidates are scored as the round's strategy
    assert (extractor.extract_from(ctx, cands[:1])[0].numpy()[:, -1] == 1).all()
