"""DerivationTransform: verified rewrites, unchanged unsupported modules, planted faults."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm_ffi import structural_equal

from conftest import compile_vm, run_vm
from tvm_einweld.expr.expression import Expr
from tvm_einweld.relay_passes.derivation import Derivation, Proposal, Rule
from tvm_einweld.relay_passes.derivation_transform import DerivationTransform

RNG = np.random.default_rng(0)


def _const(*shape):
    return relax.const(RNG.uniform(-1, 1, shape).astype("float32"))


def conv_relu_conv(channels: int = 8, size: int = 12):
    x = relax.Var("x", relax.TensorType((1, channels, size, size), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            c1 = bb.emit(relax.op.nn.conv2d(x, _const(channels, channels, 3, 3), padding=1))
            r1 = bb.emit(relax.op.nn.relu(c1))
            c2 = bb.emit(relax.op.nn.conv2d(r1, _const(channels, channels, 3, 3), padding=1))
            out = bb.emit_output(c2)
        bb.emit_func_output(out)
    return bb.get()


def matmul_model():
    x = relax.Var("x", relax.TensorType((96, 128), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            m = bb.emit(relax.op.matmul(x, _const(128, 64)))
            out = bb.emit_output(bb.emit(relax.op.tanh(m)))
        bb.emit_func_output(out)
    return bb.get()


def run(mod, inputs):
    return run_vm(mod, *inputs)


def assert_same_results(a, b, trials: int = 2):
    shapes = [tuple(int(v) for v in p.ty.shape.values) for p in a["main"].params]
    for t in range(trials):
        rng = np.random.default_rng(100 + t)
        inputs = [rng.uniform(-1, 1, s).astype("float32") for s in shapes]
        np.testing.assert_allclose(run(a, inputs), run(b, inputs), rtol=1e-4, atol=1e-4)


SMALL = dict(max_depth=2, max_states=40, time_limit_s=3.0, max_instantiations=4)


def test_conv_relu_conv_same_results(fresh_decisions):
    mod = conv_relu_conv()
    log = []
    # As users run it: a pass in a Sequential before tvm.compile.
    new = tvm.transform.Sequential([DerivationTransform(**SMALL, log=log)])(mod)
    assert_same_results(new, mod)
    assert len(log) == 2 and all(r["ops"] == ["relax.nn.conv2d"] for r in log)
    for rec in log:
        assert rec["stats"]["states"] >= 1 and rec["candidates"] >= 1
        assert rec["chosen"]["est_time_s"] <= rec["chosen"]["orig_time_s"]


def test_rewrite_log_instrument_receives_records_from_a_pipeline(tmp_path):
    """The PassContext way to log: a RewriteLog instrument sees the pass also when it runs
    nested inside the einweld pipeline's pass, and writes the same records as JSON lines."""
    import json

    from tvm_einweld.einweld_pipeline import EinweldOptimize
    from tvm_einweld.relay_passes import RewriteLog

    path = tmp_path / "rewrites.jsonl"
    sink = RewriteLog(path)
    with tvm.transform.PassContext(instruments=[sink]):
        EinweldOptimize("llvm", fuse=False, derive_options=SMALL)(conv_relu_conv())
    assert len(sink.records) == 2 and all(r["ops"] == ["relax.nn.conv2d"] for r in sink.records)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == sink.records
    assert all("rules" in r["chosen"] and "verified" in r["chosen"] for r in lines)
    # Outside the context nothing is logged any more.
    DerivationTransform(**SMALL)(conv_relu_conv())
    assert len(sink.records) == 2


def test_forced_rewrites_are_verified_and_correct():
    """With the gain requirement off, the cheapest derived program by estimate is applied: the
    rewrite path itself (instantiation, splicing, FoldConstant) must keep the results."""
    mod = conv_relu_conv(channels=4, size=8)
    log = []
    transform = DerivationTransform(max_depth=7, max_states=300, time_limit_s=8.0,
                                    max_instantiations=4, min_speedup=0,
                                    confirm_by_measurement=False, log=log)
    new = transform(mod)
    applied = [r for r in log if r["applied"]]
    assert applied, [r["notes"] for r in log]
    for rec in applied:
        assert rec["chosen"]["verified"] and rec["chosen"]["rules"]
        assert rec["chosen"]["ops"] != rec["ops"]
        assert rec["verification"].startswith("equal")
    assert not structural_equal(new, mod)
    assert_same_results(new, mod)
    # Among the candidates: the search's conv → Matmul + OffsetReduce program.
    kernels = [c.ops for r in transform.last_results for o in r.ops for c in o.candidates
               if c.label == "derived"]
    assert any(any(k in ("relax.matmul", "tvm_einweld.numpy_gemm") for k in ops)
               and "eop:OffsetReduce" in ops for ops in kernels), kernels


def test_two_matmuls_sharing_an_input_become_one():
    x = relax.Var("x", relax.TensorType((32, 48), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            m1 = bb.emit(relax.op.matmul(x, _const(48, 16)))
            m2 = bb.emit(relax.op.matmul(x, _const(48, 24)))
            out = bb.emit_output(relax.Tuple([m1, m2]))
        bb.emit_func_output(out)
    mod = bb.get()
    log = []
    transform = DerivationTransform(max_depth=0, max_states=1, time_limit_s=3.0,
                                    min_speedup=0, confirm_by_measurement=False,
                                    providers=False, log=log)
    new = transform(mod)
    (rec,) = log
    assert rec["applied"] and rec["chosen"]["verified"]
    assert rec["chosen"]["rules"] == ["expression_merging"]
    assert rec["chosen"]["ops"].count("relax.matmul") == 1, rec["chosen"]["ops"]
    run_new, run_old = compile_vm(new), compile_vm(mod)
    for t in range(2):
        a = np.random.default_rng(t).uniform(-1, 1, (32, 48)).astype("float32")
        for got, ref in zip(run_new(a), run_old(a)):
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_matmul_providers_keep_results():
    """The numpy-BLAS provider (opt-in, `providers=True`) computes what the matmul did."""
    mod = matmul_model()
    log = []
    new = DerivationTransform(**SMALL, min_speedup=0, confirm_by_measurement=False,
                              providers=True, log=log)(mod)
    (rec,) = log
    assert rec["applied"] and rec["chosen"]["ops"] != ["relax.matmul"]
    assert_same_results(new, mod)
    labels = {c for c in rec["chosen"]["ops"]}
    assert labels  # numpy_gemm or a derived program, whichever was estimated cheapest


def test_unsupported_ops_pass_through_unchanged():
    x = relax.Var("x", relax.TensorType((1, 4, 8, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            p = bb.emit(relax.op.nn.max_pool2d(x, pool_size=(2, 2), strides=(2, 2)))
            s = bb.emit(relax.op.nn.softmax(p))
            m = bb.emit(relax.op.mean(s, axis=[1]))
            out = bb.emit_output(m)
        bb.emit_func_output(out)
    mod = bb.get()
    transform = DerivationTransform(**SMALL)
    new = transform(mod)
    assert structural_equal(new, mod)
    assert transform.last_results == ()


class _Wrong(Rule):
    """A planted faulty rule: claims a convolution equals its input (wrong, and estimated
    free, so the pass picks it and only verification stands in the way)."""

    name = "planted_wrong"

    def propose(self, expr: Expr):
        from tvm_einweld.expr.expression import Tensor, accesses

        data = next(accesses(expr.body)).source
        if isinstance(data, Tensor) and data.shape == expr.shape:
            wrong = Tensor(data.name, data.shape, dtype=data.dtype)
            body = wrong[tuple(it.var for it in expr.traversals)]
            yield Proposal.proven(Derivation(self.name, Expr(expr.traversals, (), body,
                                                             expr.dtype), (),
                                             "conv = identity (wrong)"))


def test_planted_wrong_rule_is_rejected():
    mod = conv_relu_conv(channels=4, size=8)
    log = []
    transform = DerivationTransform(max_depth=1, max_states=10, time_limit_s=3.0,
                                    rules=[_Wrong()], targets={}, min_speedup=0,
                                    confirm_by_measurement=False, providers=False, log=log)
    new = transform(mod)
    assert structural_equal(new, mod)
    assert log and all(not r["applied"] for r in log)
    for rec in log:
        assert not rec["chosen"]["verified"] and "NOT equal" in rec["verification"]
        assert any("rewrite rejected" in n for n in rec["notes"])


def test_a_target_without_its_device_leaves_the_module_unchanged():
    import pytest

    mod = matmul_model()
    transform = DerivationTransform(**SMALL, target="cuda")
    if tvm.cuda(0).exist:  # a GPU machine: candidates are timed and verified there
        transform(mod)
        assert len(transform.last_results) == 1
        return
    with pytest.warns(UserWarning, match="no cuda device"):
        new = transform(mod)
    assert structural_equal(new, mod) and transform.last_results == ()


def test_fastest_measured_rewrite_is_kept_not_the_estimates_favourite():
    """eOperator times are estimates: the pass verifies and times the few cheapest rewrites
    by estimate and keeps the fastest measured one (here the estimate's second choice),
    never one slower than the original."""
    from tvm_einweld.relay_passes.candidates import OpResult, Program, SubprogramResult
    from tvm_einweld.relay_passes.op_cost import Kernel

    def program(label, est):
        return Program(label, (Kernel("k", est, False),), emit=None)

    original, fav, second, third = (program("original", 1.0), program("fav", 0.1),
                                    program("second", 0.2), program("third", 0.3))
    measured = {"original": 1.0, "fav": 2.0, "second": 0.4, "third": 0.6}
    tried = []
    transform = DerivationTransform(measured_attempts=3)

    def try_rewrite(sub, ops):
        chosen = ops[0].chosen
        tried.append(chosen.label)
        after = measured[chosen.label]
        applied = after < measured["original"]
        # As the pass does: a timed rewrite is recorded as tried; a slower one is not kept.
        kept = tuple(OpResult(o.op, o.candidates, o.chosen if applied else o.original, o.stats,
                              tried=o.tried + (o.chosen,)) for o in ops)
        return SubprogramResult(sub, kept, applied, True, "equal", measured["original"], after)

    inner = transform._inst  # the pass object behind TVM's module_pass wrapper
    inner.optimise_op = lambda op: OpResult(op, (original, fav, second, third), fav, None)
    inner.merge_pairs = lambda sub, ops: tuple(ops)
    inner._try_rewrite = try_rewrite

    class Sub:
        ops = ("conv",)

    result = transform.optimise_subprogram(Sub())
    assert tried == ["fav", "second", "third"]
    assert result.applied and result.ops[0].chosen is second
    assert result.measured_after_s == measured["second"]

    # All slower than the original: the original stays.
    measured.update(second=1.5, third=1.2)
    tried.clear()
    result = transform.optimise_subprogram(Sub())
    assert not result.applied and result.ops[0].chosen is original


def two_matmul_layers():
    """Two layers computing the same function (same shapes, constant weights) on different
    tensors, cut apart by an activation."""
    x = relax.Var("x", relax.TensorType((32, 64), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            m1 = bb.emit(relax.op.matmul(x, _const(64, 64)))
            r1 = bb.emit(relax.op.tanh(m1))
            m2 = bb.emit(relax.op.matmul(r1, _const(64, 64)))
            out = bb.emit_output(bb.emit(relax.op.tanh(m2)))
        bb.emit_func_output(out)
    return bb.get()


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """An empty decision cache of this test only (on disk and in memory)."""
    from tvm_einweld import machine

    monkeypatch.setenv("TVM_EINWELD_CACHE", str(tmp_path))
    monkeypatch.setattr(machine, "_TIMES", {})
    return tmp_path


def test_repeated_layers_are_searched_once_and_no_winner_is_cached(private_cache):
    """The second layer reuses the first one's search (same computation, other tensors); a
    search that found nothing cheaper is recorded in the decision cache, so a later compile
    skips it and makes the same (unchanged) choice."""
    mod = two_matmul_layers()
    # No derived program can be 1e9x cheaper: the original is kept whatever the search finds.
    options = dict(SMALL, min_speedup=1e9, confirm_by_measurement=False)
    transform = DerivationTransform(**options)
    out = transform(mod)
    first, second = (r.ops[0] for r in transform.last_results)
    assert first.stats is not None and first.chosen is first.original
    assert any("search shared" in n for n in second.notes)
    assert len(second.candidates) == len(first.candidates)
    assert structural_equal(out, mod)

    again = DerivationTransform(**options)
    again(mod)
    for result in again.last_results:
        op = result.ops[0]
        assert op.stats is None and op.chosen is op.original
        assert any("decision cache" in n for n in op.notes)


def test_a_shared_search_still_rewrites_each_layer_correctly(private_cache):
    """Forced rewrites (min_speedup=0) of two equal convolutions: the second one's candidates
    come from the first one's search, emitted on its own tensors, and the module stays
    correct."""
    mod = conv_relu_conv(channels=4, size=8)
    transform = DerivationTransform(max_depth=7, max_states=300, time_limit_s=8.0,
                                    max_instantiations=4, min_speedup=0,
                                    confirm_by_measurement=False)
    out = transform(mod)
    first, second = (r.ops[0] for r in transform.last_results)
    assert any("search shared" in n for n in second.notes)
    assert [c.rules for c in first.candidates] == [c.rules for c in second.candidates]
    assert all(r.applied for r in transform.last_results), \
        [r.verification for r in transform.last_results]
    assert second.chosen.label == "derived"
    assert_same_results(mod, out)


def test_an_operator_without_alternatives_is_not_timed(private_cache, monkeypatch):
    """The original is timed only to be held against another candidate: when the search
    finds none, nothing is built or run for the operator (its cost stays the roofline's);
    when it finds some, the original is timed like them."""
    from tvm_einweld.tir_passes import measure

    timed = []  # every module timed, whichever way (one by one or in a batch)
    real = measure.measure_modules
    monkeypatch.setattr(measure, "measure_modules",
                        lambda mods, *a, **k: timed.extend(mods) or real(mods, *a, **k))
    mod = conv_relu_conv(channels=4, size=8)
    transform = DerivationTransform(**SMALL, confirm_by_measurement=False)
    inner = transform._inst  # the pass object behind TVM's module_pass wrapper
    inner._search_op = lambda op, signature: ([], None, (), [])
    assert structural_equal(transform(mod), mod)
    convs = [o for r in transform.last_results for o in r.ops if o.op.kind == "relax.nn.conv2d"]
    assert convs and not timed
    assert all(not k.measured for o in convs for k in o.original.kernels)

    # Searched for real, in a cache of its own (the run above recorded "no winner").
    from tvm_einweld import machine

    monkeypatch.setenv("TVM_EINWELD_CACHE", str(private_cache / "second"))
    monkeypatch.setattr(machine, "_TIMES", {})
    transform = DerivationTransform(max_depth=7, max_states=300, time_limit_s=8.0,
                                    max_instantiations=4, confirm_by_measurement=False)
    transform(mod)
    convs = [o for r in transform.last_results for o in r.ops if o.op.kind == "relax.nn.conv2d"]
    with_alternatives = [o for o in convs if len(o.candidates) > 1]
    assert with_alternatives and timed
    assert all(k.measured for o in with_alternatives for k in o.original.kernels
               if k.name == "relax.nn.conv2d")


def test_an_operator_with_a_tiny_share_of_the_flops_is_not_searched(private_cache):
    """A convolution holding under `min_flop_share` of the module's FLOPs is left as it is,
    without a search or a timing (it could save no more than its share), and says why; the
    large one next to it is searched as before. What is skipped depends on FLOPs only."""
    x = relax.Var("x", relax.TensorType((1, 16, 24, 24), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            big = bb.emit(relax.op.nn.conv2d(x, _const(16, 16, 3, 3), padding=1))
            r = bb.emit(relax.op.nn.relu(big))
            small = bb.emit(relax.op.nn.conv2d(r, _const(1, 16, 1, 1)))
            out = bb.emit_output(small)
        bb.emit_func_output(out)
    mod = bb.get()
    transform = DerivationTransform(**SMALL, confirm_by_measurement=False, min_flop_share=0.1)
    searched = []
    inner = transform._inst
    real = inner._search_op
    inner._search_op = lambda op, signature: searched.append(op) or real(op, signature)
    out = transform(mod)
    ops = [o for r in transform.last_results for o in r.ops]
    small_op = next(o for o in ops if "not searched" in " ".join(o.notes))
    assert small_op.stats is None and small_op.chosen is small_op.original
    assert "below min_flop_share" in " ".join(small_op.notes)
    assert len(searched) == 1 and searched[0] is not small_op.op
    assert_same_results(mod, out)
