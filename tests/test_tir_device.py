"""Device model: CPU levels from sysfs with cached measured bandwidths; static CUDA sheets."""
import json
from pathlib import Path

import pytest
import tvm

from tvm_einweld.tir_passes import device as dev


def _sysfs_size(level: int) -> int:
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        if int((index / "level").read_text()) == level and (
                index / "type").read_text().strip() != "Instruction":
            text = (index / "size").read_text().strip()
            return int(text.rstrip("KM")) * {"K": 1024, "M": 1 << 20}[text[-1]]
    raise AssertionError(f"no L{level} data cache in sysfs")


def test_cpu_levels_come_from_sysfs_and_bandwidth_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TVM_EINWELD_CACHE", str(tmp_path))
    cpu = dev.cpu_device()
    names = [level.name for level in cpu.levels]
    assert names == ["DRAM", "L2", "L1"]
    assert cpu.level(1).capacity == _sysfs_size(2)
    assert cpu.level(2).capacity == _sysfs_size(1)
    assert cpu.level(0).capacity > cpu.level(1).capacity > cpu.level(2).capacity
    assert all(level.bandwidth > 0 for level in cpu.levels)
    cached = json.loads((tmp_path / "cpu_bandwidth.json").read_text())
    assert cached["bandwidth"]["DRAM"] == cpu.level(0).bandwidth
    # A second construction reads the file instead of measuring: plant a value and see it back.
    cached["bandwidth"]["DRAM"] = 123.0
    (tmp_path / "cpu_bandwidth.json").write_text(json.dumps(cached))
    assert dev.cpu_device().level(0).bandwidth == 123.0


@pytest.mark.parametrize("name,sms", [("v100", 80), ("a100", 108), ("h100", 132)])
def test_cuda_sheets_need_no_gpu(name, sms):
    gpu = dev.cuda_device(name)
    assert gpu.kind == "cuda" and gpu.parallel_units == sms
    assert gpu.level(gpu.fuse_level).name == "shared"
    # The tile kernels' buffers are static __shared__ arrays: 48 KiB per block on every GPU
    # (the sheets' larger opt-in maxima are for dynamic shared memory only).
    assert gpu.level(1).capacity == 48 * 1024 == dev.CUDA_STATIC_SHARED_BYTES
    assert dev.shared_limits(gpu) == (48 * 1024, 48 * 1024)
    assert gpu.level(0).bandwidth < gpu.level(1).bandwidth < gpu.level(2).bandwidth


def test_static_shared_limit_holds_whatever_the_budget():
    from dataclasses import replace

    gpu = dev.cuda_device("h100")
    big = replace(gpu, levels=(gpu.levels[0], replace(gpu.levels[1], capacity=227 * 1024),
                               gpu.levels[2]))
    small = replace(gpu, levels=(gpu.levels[0], replace(gpu.levels[1], capacity=16 * 1024),
                                 gpu.levels[2]))
    assert dev.shared_limits(big) == (48 * 1024, 227 * 1024)
    assert dev.shared_limits(small) == (16 * 1024, 16 * 1024)


def test_device_for_target():
    assert dev.device_for_target("llvm").kind == "cpu"
    h100 = dev.device_for_target(tvm.target.Target({"kind": "cuda", "arch": "sm_90"}))
    assert h100.name == "h100"
    with pytest.raises(ValueError):
        dev.cuda_device("not-a-gpu")
