"""Tile-graph memory scheduling (Welder, OSDI'23) as TIR passes on stock TVM 0.27.

Modules, in the order data flows through them:
  device      the abstract accelerator: memory levels, transaction width, bandwidth, parallel units
  tile_graph  nodes (PrimFunc calls) and edges (tensors) of a legalized Relax function
  propagate   output tile -> input/intermediate tiles with TVM's bound analysis
  cost        MemTraffic / MemFootprint / parallelism penalty of a tiled sub-graph
  scheduler   GraphConnecting + SubGraphTiling (Figure 7)
  codegen     one tiled PrimFunc per group (FuseTIR + compute_at + device mapping)
  localize    the TIR pass turning global intermediates into per-tile buffers
  measure     build, time and check kernels on the target
  fusion      TileGraphFusion, the Relax module pass
"""
from .device import Device, MemoryLevel, cpu_device, cuda_device, device_for_target
from .fusion import TileGraphFusion, compile_pipeline, pipeline, prepare
from .localize import LocalizeIntermediates

__all__ = [
    "Device", "MemoryLevel", "cpu_device", "cuda_device", "device_for_target",
    "TileGraphFusion", "compile_pipeline", "pipeline", "prepare", "LocalizeIntermediates",
]
