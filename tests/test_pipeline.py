"""The "einweld" Relax pipeline: registered on import, and equal to the stock build."""
import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_einweld
from tvm_einweld.commands.demo import builtin_model


def run(ex, x):
    return relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


def test_pipeline_is_registered_under_its_name():
    assert "einweld" in relax.pipeline.PIPELINE_MAP
    assert isinstance(relax.get_pipeline("einweld"), tvm.transform.Pass)


def test_pipeline_matches_the_stock_build():
    mod = builtin_model(channels=8, size=10)
    x = np.random.default_rng(0).uniform(-1, 1, (1, 8, 10, 10)).astype("float32")
    expected = run(tvm.compile(mod, "llvm"), x)
    ex = tvm.compile(mod, "llvm", relax_pipeline=tvm_einweld.pipeline(fuse_options={"topk": 2}))
    np.testing.assert_allclose(run(ex, x), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_pipeline_with_tuning_matches_the_stock_build(tmp_path):
    """trials > 0: the kernels are tuned with layout strategies (fusion off, so every kernel
    is a task) and the tuned, weight-prepacked build still equals the stock build."""
    mod = builtin_model(channels=8, size=10)
    x = np.random.default_rng(0).uniform(-1, 1, (1, 8, 10, 10)).astype("float32")
    expected = run(tvm.compile(mod, "llvm"), x)
    stages = tvm_einweld.EinweldOptimize(trials=8, work_dir=str(tmp_path), derive=False,
                                         fuse=False)
    ex = tvm.compile(mod, "llvm", relax_pipeline=tvm.transform.Sequential(
        [stages, relax.pipeline.default_build_pipeline()]))
    assert stages.tuned and any(tmp_path.iterdir())
    np.testing.assert_allclose(run(ex, x), expected, rtol=1e-4, atol=1e-4)
