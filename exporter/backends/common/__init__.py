"""What the backends share to lower a program: the Artifact the lowering stage hands on, the
fallback policy judged per node and the partition report it yields, ExecuTorch's lowering to a
.pte under a partitioner (XNNPACK's or WebGPU's), the checks of a PyTorch device, and rewrites of
an exported program (new calls made as export makes them: graph_edits.py).

Each backend module in exporter/backends/ imports from here inside its functions, so composing a
config, which imports every backend module, imports no toolchain.
"""
