"""Run the CUDA code tvm_einweld generates on a real GPU and check its answers.

Two halves, because the GPU machines lent to some sessions have Python 3.12, numpy and a CUDA
toolkit but no TVM (and at most 64 MiB of files travel there, less than TVM's compiler library):

1. Here (TVM and nvcc, no GPU needed), packed into an ignored folder (`/.gpu/` in
   .git/info/exclude)::

       .venv/bin/python benchmarks/cuda_device_check.py --export /tmp/cdc \\
           --ffi-wheel /tmp/whl/apache_tvm_ffi-0.1.14.post1-cp312-*.whl \\
           --pack .gpu/pack.tar.xz                                     # then: du -sh .gpu

   Each check is built for {"kind": "cuda", "arch": "sm_90"} by tvm_einweld ("einweld":
   `TileGraphFusion` for the Welder workloads, the einweld Relax pipeline for the zoo models;
   every tile kernel checked as emitted, its shared memory within the 48 KiB a block may
   declare statically) and by stock TVM ("stock": `tvm.compile`, its default CUDA pipeline
   with DLight schedules). The folder gets the exported libraries, random inputs, references
   (TVM's CPU build for the workloads, onnxruntime for the models), manifest.json (per
   einweld build: its groups, and the tile kernels the check refused and why), TVM's Python
   package without libtvm_compiler.so, libcudart.so.13 and the tvm-ffi wheel. Without a CUDA
   driver TVM exports kernels as CUDA source, compiled when the library is loaded; so each
   source is also compiled here with nvcc (TVM's flags, fatbin; `-Xptxas -v` for each
   kernel's shared memory) and any failure is recorded in the manifest.
   (The first run, at f6d0d92, also built "einweld_smem48k", the H100 model with 48 KiB of
   shared memory per block; that is now the model itself.) `--pack` writes the folder as one
   xz tar (about 85 MB as files, 51 MB packed: DCGAN's two libraries carry 29 MB of weights).

2. On the GPU machine (the `run` tool, carry [".gpu"], timeout_s 300; about 60 s of run time
   on an H200), each check in a process of its own (a library that crashes the process, as
   the einweld FSRCNN and DCGAN builds did before `einweld_pipeline.gpu_schedules`, then
   costs its own row only), merged into one report::

       python3 -c "import tarfile; tarfile.open('.gpu/pack.tar.xz').extractall('/tmp/g')" &&
       python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/g/*.whl || exit 1
       export PYTHONPATH=/tmp/site PATH=$PATH:/usr/local/cuda/bin PYTHONUNBUFFERED=1
       for c in $(python3 -c "import json; print(*[c['name'] for c in json.load(open(
               '/tmp/g/manifest.json'))['checks']])"); do
           python3 benchmarks/cuda_device_check.py --run /tmp/g --out /tmp/r --only $c \\
               >> $OUT/log.txt 2>&1 || echo "$c: exit $?" >> $OUT/log.txt; done
       python3 benchmarks/cuda_device_check.py --merge /tmp/g --results /tmp/r --out $OUT

   TVM is imported runtime-only (TVM_USE_RUNTIME_LIB=1, plus libtvm_runtime_cuda.so); TVM's
   load-time compile hook is given the fatbin built here for each source (by sha256; nvcc runs
   there only for a source that did not compile here, to show its error on the machine). Each
   library runs in a Relax VirtualMachine on cuda(0) against its reference and is timed (median
   of 50 repeats of 10 runs, TVM's time_evaluator). Results: OUT/result.json and OUT/result.md.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy as np

TARGET = {"kind": "cuda", "arch": "sm_90"}
RTOL, ATOL_SCALE = 1e-3, 1e-4  # |got - ref| <= RTOL * |ref| + ATOL_SCALE * max(1, max |ref|)
MODELS = ["fsrcnn", "nafnet", "mobilenetv2", "nerf", "dcgan"]  # (vit: 22 MiB, too much to carry)


# ------------------------------------------------------------------------------------ export
def _fusion_report(report) -> Dict[str, Any]:
    """What a TileGraphFusion run planned (groups, tiles, modelled footprints) and which tile
    kernels its check of what is emitted refused, and why."""
    if report is None:
        return {"groups": [], "refused": []}
    return {"groups": [f"{[n.name for n in g.sub.nodes]} tile "
                       f"{g.candidate.config.tile if g.candidate else None} footprint "
                       f"{g.candidate.cost.footprint if g.candidate else None} B"
                       for g in report.plan.groups],
            "refused": [f"{list(names)} tile {list(tile)}: {why}"
                        for names, tile, why in report.refused]}


def _workloads() -> Dict[str, Any]:
    """Welder workloads: name -> un-legalized Relax module."""
    from tvm_einweld.tir_passes import workloads

    return {"matmul_softmax": workloads.matmul_softmax(16384, 64, 128),
            "conv_relu_maxpool": workloads.conv_relu_maxpool(1, 16, 56, 32),
            "layernorm_chain": workloads.layernorm_chain(2048, 256),
            "bert_attention": workloads.bert_attention(128, 256, 4)}


def _cuda_sources(executable) -> List[str]:
    found: List[str] = []

    def walk(module) -> None:
        if module.kind == "cuda":
            found.append(module.inspect_source())
        for sub in module.imports:
            walk(sub)

    walk(executable.mod)
    return found


def _export_variant(out: Path, name: str, build: Callable[[], Any]) -> Dict[str, Any]:
    """Build, export, and nvcc-compile the kernels of one variant; record what failed."""
    import tvm
    from tvm.support import nvcc

    entry: Dict[str, Any] = {"file": None}
    start = time.perf_counter()
    try:
        executable = build()
    except Exception as err:  # noqa: BLE001 - a failed build is a finding, recorded
        entry["build_error"] = traceback.format_exception_only(err)[-1].strip()[-2000:]
        return entry
    entry["build_s"] = round(time.perf_counter() - start, 2)
    executable.export_library(str(out / f"{name}.so"))
    entry["file"] = f"{name}.so"
    entry["kernels"] = []
    for code in _cuda_sources(executable):
        digest = hashlib.sha256(code.encode()).hexdigest()
        kernel: Dict[str, Any] = {"sha256": digest, "lines": code.count("\n")}
        try:
            with tvm.target.Target(TARGET):
                binary = nvcc.compile_cuda(code, target_format="fatbin", compiler="nvcc")
            (out / "fatbin" / f"{digest}.fatbin").write_bytes(bytes(binary))
            kernel["smem"] = _ptxas_smem(code)
        except Exception as err:  # noqa: BLE001
            lines = [l for l in str(err).splitlines() if "error" in l.lower()]
            kernel["nvcc_error"] = "\n".join(l for l in lines if "Compilation" not in l)
        entry["kernels"].append(kernel)
    smem = [v for k in entry["kernels"] for v in k.get("smem", {}).values()]
    entry["max_smem"] = max(smem, default=0)
    return entry


def _ptxas_smem(code: str) -> Dict[str, int]:
    """{kernel: bytes of shared memory} as ptxas reports them (`nvcc -Xptxas -v`)."""
    import re
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.cu").write_text(code)
        done = subprocess.run(["nvcc", "--cubin", "-O3", "-arch=sm_90", "-Xptxas", "-v",
                               "-o", f"{tmp}/k.cubin", f"{tmp}/k.cu"],
                              capture_output=True, text=True)
    found, kernel = {}, None
    for line in (done.stdout + done.stderr).splitlines():
        name = re.search(r"Compiling entry function '(\w+)'", line)
        if name:
            kernel = name.group(1)
        smem = re.search(r"(\d+) bytes smem", line)
        if smem and kernel:
            found[kernel] = int(smem.group(1))
    return found


def export(out: Path, ffi_wheel: str | None) -> None:
    """Build every check for TARGET and write it, with a runtime-only TVM, into `out`."""
    import onnxruntime as ort
    import tvm
    from tvm.relax.frontend.onnx import from_onnx

    import tvm_einweld  # noqa: F401 - registers the einweld pipeline's pieces
    from tvm_einweld.einweld_pipeline import EinweldOptimize, lowering
    from tvm_einweld.models import build_model, random_inputs
    from tvm_einweld.tir_passes import TileGraphFusion, prepare

    (out / "fatbin").mkdir(parents=True, exist_ok=True)
    target = tvm.target.Target(TARGET)
    checks: List[Dict[str, Any]] = []

    def save(name: str, kind: str, inputs: Dict[str, np.ndarray], ref: List[np.ndarray],
             builds: Dict[str, Callable[[], Any]], fusions: Dict[str, Callable[[], Any]]
             ) -> None:
        variants = {v: _export_variant(out, f"{name}_{v}", build) for v, build in builds.items()}
        for variant, report in fusions.items():
            variants[variant].update(_fusion_report(report()))
        checks.append({"name": name, "kind": kind, "variants": variants, "inputs": list(inputs)})
        np.savez(out / f"{name}_in.npz", **inputs)
        np.savez(out / f"{name}_ref.npz", *ref)

    rng = np.random.default_rng(0)
    for name, mod in _workloads().items():
        inputs = {p.name: rng.standard_normal([int(d) for d in p.ty.shape.values])
                  .astype("float32") for p in mod["main"].params}
        cpu = tvm.runtime.vm.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
        ref = [cpu["main"](*[tvm.runtime.tensor(v) for v in inputs.values()]).numpy()]
        fusion = TileGraphFusion(target, topk=1)
        builds = {"einweld": lambda f=fusion, m=mod: tvm.compile(f(prepare()(m)), target=target),
                  "stock": lambda m=mod: tvm.compile(m, target)}
        save(name, "Welder workload, TileGraphFusion (reference: TVM llvm build)", inputs, ref,
             builds, {"einweld": lambda f=fusion: f.report})
    for name in MODELS:
        model = build_model(name, 1)
        inputs = random_inputs(model)
        ref = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, inputs)
        mod = from_onnx(model, keep_params_in_input=False)
        optimize = EinweldOptimize(target)  # the "einweld" pipeline: it, then lowering()
        builds = {"einweld": lambda o=optimize, m=mod: tvm.compile(
            m, target, relax_pipeline=tvm.transform.Sequential([o, lowering()])),
                  "stock": lambda m=mod: tvm.compile(m, target)}
        save(name, "zoo model, einweld pipeline (reference: onnxruntime CPU)", inputs, ref,
             builds, {"einweld": lambda o=optimize: o.fusion.report if o.fusion else None})
    (out / "manifest.json").write_text(json.dumps({"target": TARGET, "commit": _commit(),
                                                   "checks": checks}, indent=1))
    # Runtime-only TVM: the Python package without the compiler library and sources.
    package = Path(tvm.__file__).parent
    shutil.rmtree(out / "tvm", ignore_errors=True)
    shutil.copytree(package, out / "tvm", ignore=shutil.ignore_patterns(
        "libtvm_compiler.so", "__pycache__", "3rdparty", "src", "include", "web", "lib64"))
    cudart = glob.glob("/usr/local/cuda*/lib*/libcudart.so.13")
    if cudart:
        shutil.copy(cudart[0], out / "libcudart.so.13")
    if ffi_wheel:
        shutil.copy(ffi_wheel, out)


def _commit() -> str:
    """The commit the export was built from ("+dirty" when tracked files differ from it)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "tvm_einweld"],
                               cwd=root).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def pack(folder: Path, archive: Path) -> None:
    """`folder`'s files as one xz tar (preset 9, extreme): what travels to the GPU machine."""
    import lzma
    import tarfile

    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:xz", preset=9 | lzma.PRESET_EXTREME) as tar:
        for path in sorted(folder.iterdir()):
            tar.add(path, arcname=path.name)


# --------------------------------------------------------------------------------------- run
def _load_runtime(folder: Path) -> Dict[str, int]:
    """Import TVM runtime-only from `folder`, with its CUDA runtime and a compile hook that
    serves the fatbins built at export time. Returns the hook's counters."""
    os.environ["TVM_USE_RUNTIME_LIB"] = "1"
    sys.path.insert(0, str(folder))
    if (folder / "libcudart.so.13").exists():
        ctypes.CDLL(str(folder / "libcudart.so.13"), mode=ctypes.RTLD_GLOBAL)
    import tvm
    import tvm_ffi

    ctypes.CDLL(str(Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"),
                mode=ctypes.RTLD_GLOBAL)
    counts = {"prebuilt": 0, "nvcc_here": 0}

    def compile_hook(code: str, *_: Any) -> bytes:
        path = folder / "fatbin" / f"{hashlib.sha256(code.encode()).hexdigest()}.fatbin"
        if path.exists():
            counts["prebuilt"] += 1
            return path.read_bytes()
        counts["nvcc_here"] += 1
        work = Path(f"/tmp/cdc_{os.getpid()}")
        work.mkdir(exist_ok=True)
        (work / "k.cu").write_text(code)
        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        done = subprocess.run([nvcc, "--fatbin", "-O3", "-arch=sm_90", "--use_fast_math",
                               "-o", str(work / "k.fatbin"), str(work / "k.cu")],
                              capture_output=True, text=True)
        if done.returncode:
            errors = [l for l in (done.stdout + done.stderr).splitlines() if "error" in l]
            raise RuntimeError("nvcc on this machine: " + "\n".join(errors)[-1500:])
        return (work / "k.fatbin").read_bytes()

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", compile_hook, override=True)
    return counts


def _outputs(value) -> List[np.ndarray]:
    if hasattr(value, "numpy"):
        return [value.numpy()]
    return [o for item in value for o in _outputs(item)]


def _run_variant(folder: Path, entry: Dict[str, Any], inputs: List[np.ndarray],
                 refs: List[np.ndarray]) -> Dict[str, Any]:
    import tvm
    from tvm.runtime.vm import VirtualMachine

    dev = tvm.cuda(0)
    try:
        vm = VirtualMachine(tvm.runtime.load_module(str(folder / entry["file"])), dev)
        args = [tvm.runtime.tensor(a, device=dev) for a in inputs]
        got = _outputs(vm["main"](*args))
        dev.sync()
    except Exception as err:  # noqa: BLE001 - a failure to load or run is a finding
        return {"status": "RUN FAILED", "error": str(err).strip()[-1500:]}
    result: Dict[str, Any] = {"max_abs": 0.0, "max_rel": 0.0, "ok": len(got) == len(refs)}
    for out, ref in zip(got, refs):
        scale = max(1.0, float(np.abs(ref).max()))
        err = float(np.abs(out.astype("float64") - ref).max()) if out.shape == ref.shape else 1e30
        result["max_abs"] = max(result["max_abs"], err)
        result["max_rel"] = max(result["max_rel"], err / float(np.abs(ref).max() or 1.0))
        result["ok"] &= out.shape == ref.shape and bool(np.all(np.isfinite(out))) and \
            bool(np.allclose(out, ref, rtol=RTOL, atol=ATOL_SCALE * scale))
    timer = vm.time_evaluator("main", dev, number=10, repeat=50)
    result["median_ms"] = float(np.median(timer(*args).results) * 1e3)
    result["status"] = "PASS" if result["ok"] else "WRONG"
    return result


def _device_line() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "nvidia-smi unavailable"


def run(folder: Path, out: Path, only: str | None = None) -> int:
    """Run every exported library (or the checks named in `only`, comma-separated) on
    cuda(0); write result.json and result.md (result_<only>.*) into `out`."""
    counts = _load_runtime(folder)
    import tvm

    manifest = json.loads((folder / "manifest.json").read_text())
    try:
        compute = tvm.cuda(0).compute_version
    except Exception as err:  # noqa: BLE001 - no usable GPU: every run below fails and says why
        compute = f"unknown ({str(err).splitlines()[-1]})"
    report: Dict[str, Any] = {"device": _device_line(), "date": time.strftime("%Y-%m-%d %H:%M"),
                              "compute": compute, "commit": manifest.get("commit"),
                              "checks": []}
    for check in manifest["checks"]:
        if only and check["name"] not in only.split(","):
            continue
        data = np.load(folder / f"{check['name']}_in.npz")
        inputs = [data[k] for k in check["inputs"]]
        ref_file = np.load(folder / f"{check['name']}_ref.npz")
        refs = [ref_file[f"arr_{i}"] for i in range(len(ref_file.files))]
        results = {}
        for variant, entry in check["variants"].items():
            print(check["name"], variant, "...", flush=True)  # the last line before a crash
            if entry.get("file") is None:
                results[variant] = {"status": "BUILD FAILED", "error": entry.get("build_error")}
            else:
                results[variant] = _run_variant(folder, entry, inputs, refs)
            results[variant]["max_smem"] = entry.get("max_smem")
            print(check["name"], variant, json.dumps(results[variant])[:600], flush=True)
        report["checks"].append({"name": check["name"], "results": results})
    report["compile_hook"] = counts
    stem = f"result_{only.replace(',', '_')}" if only else "result"
    _write(report, out, stem)
    return 0


def merge(folder: Path, results: Path, out: Path) -> int:
    """One result.json / result.md in `out` from the result_<check>.json files that `--run
    --only <check>` wrote into `results`, one process per check (a check whose process died,
    a segfault say, gets a row that says so)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    parts = {p.stem[len("result_"):]: json.loads(p.read_text())
             for p in sorted(results.glob("result_*.json"))}
    report = dict(next(iter(parts.values()), {"device": "?", "date": "?", "compute": "?"}))
    report["commit"], report["checks"] = manifest.get("commit"), []
    for check in manifest["checks"]:
        found = [c for part in parts.values() for c in part["checks"]
                 if c["name"] == check["name"]]
        report["checks"].append(found[0] if found else {"name": check["name"], "results": {
            v: {"status": "NO RESULT (its process died: see the log)"}
            for v in check["variants"]}})
    report["compile_hook"] = {p: part.get("compile_hook") for p, part in parts.items()}
    _write(report, out, "result")
    return 0


def _write(report: Dict[str, Any], out: Path, stem: str) -> None:
    """`report` as OUT/<stem>.json and a Markdown table OUT/<stem>.md (printed too)."""
    rows = ["| check | variant | status | max abs err | max rel err | median ms | einweld/stock |"
            " max smem B (ptxas) |", "|---|---|---|---|---|---|---|---|"]
    for check in report["checks"]:
        results = check["results"]
        stock = results.get("stock", {}).get("median_ms")
        for variant, res in results.items():
            fmt = (lambda k, r=res: f"{r[k]:.2e}" if k in r else "")
            ms = res.get("median_ms")
            ratio = f"{ms / stock:.2f}" if ms and stock and variant != "stock" else ""
            smem = res.get("max_smem")
            rows.append(f"| {check['name']} | {variant} | {res['status']} | {fmt('max_abs')} | "
                        f"{fmt('max_rel')} | {f'{ms:.4f}' if ms else ''} | {ratio} | "
                        f"{smem if smem is not None else ''} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    head = (f"{report['device']} (compute {report['compute']}), {report['date']}, built at "
            f"{report['commit']}\n\n")
    (out / f"{stem}.md").write_text(head + "\n".join(rows) + "\n")
    print(head + "\n".join(rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--export", metavar="DIR", help="build and export everything into DIR")
    mode.add_argument("--run", metavar="DIR", help="run DIR's libraries on the GPU")
    mode.add_argument("--merge", metavar="DIR", help="merge --run --only results of DIR's "
                      "checks (the folder given by --results) into one report in --out")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="--run's result folder")
    parser.add_argument("--only", help="--run: these checks alone (comma-separated names)")
    parser.add_argument("--results", help="--merge: the folder of result_<check>.json files")
    parser.add_argument("--ffi-wheel", help="--export: the apache-tvm-ffi cp312 wheel to copy")
    parser.add_argument("--pack", metavar="FILE", help="--export: also write DIR as an xz tar")
    args = parser.parse_args()
    if args.export:
        export(Path(args.export), args.ffi_wheel)
        if args.pack:
            pack(Path(args.export), Path(args.pack))
        return 0
    if args.merge:
        return merge(Path(args.merge), Path(args.results), Path(args.out))
    return run(Path(args.run), Path(args.out), args.only)


if __name__ == "__main__":
    sys.exit(main())
