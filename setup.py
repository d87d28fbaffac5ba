"""tvm_einweld: derivation-based transformations, tile-graph fusion and adaptive layout tuning for Apache TVM."""
from setuptools import find_packages, setup

setup(
    name="tvm_einweld",
    version="0.2.0",
    description=(
        "Apache TVM plugin: EinNet derivation-based transformations, Welder tile-graph fusion, "
        "AL-Ansor adaptive layout tuning, TASO-style verification"
    ),
    packages=find_packages(include=["tvm_einweld", "tvm_einweld.*"]),
    python_requires=">=3.10",
    install_requires=[
        "apache-tvm==0.27.0.post1",
        # 0.1.15.x segfaults in tvm.ir.save_json, which MetaSchedule calls.
        "apache-tvm-ffi==0.1.14.post1",
        "numpy",
        "onnx",
        "z3-solver",
        "xgboost",
        "psutil",
        "cloudpickle",
    ],
    extras_require={
        # tornado: TVM's RPC tracker (tests tune through RPC on loopback); matplotlib: charts;
        # openvino: the benchmark harness's OpenVINO runners are tested too
        "test": ["pytest", "onnxruntime", "tornado", "matplotlib", "openvino"],
        "plot": ["matplotlib"],
        # the peers the zoo benchmark compares with (each runner says when it is missing)
        "bench": ["onnxruntime", "openvino", "matplotlib"],
    },
    entry_points={"console_scripts": ["tvm-einweld=tvm_einweld.cli:main"]},
)
