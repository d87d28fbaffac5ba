"""tvm_einweld: a plugin for Apache TVM 0.27.

Derivation-based graph transformations (EinNet), tile-graph memory scheduling (Welder),
adaptive layout-strategy tuning (AL-Ansor) and TASO-style verification of every rewrite.
Sub-packages import TVM lazily where they can, so `import tvm_einweld` stays cheap.
"""

__version__ = "0.1.0"
