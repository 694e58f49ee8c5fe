# Spike (issue 43): one .pte, two methods; "encode" writes a buffer that "decode" reads.
# ExecuTorch 1.5.1: with MemoryPlanningPass(share_mutable_buffers=True) decode sees encode's
# write (max err 4.8e-7); without it, decode reads its own zeros (err = the output itself).
# AOTInductor: two models packaged from programs whose buffers are the same tensors share them
# at load (main, exporter/backends/aoti.py decode step). Basis for Whisper's cross-attention cache.
import torch
from executorch.exir import to_edge_transform_and_lower, ExecutorchBackendConfig
from executorch.exir.passes import MemoryPlanningPass
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

class Shared(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cross", torch.zeros(1, 8, 16), persistent=True)
        self.proj = torch.nn.Linear(16, 16)
    def encode(self, feats):
        self.cross.copy_(self.proj(feats))
        return self.cross.sum(-1)
    def decode(self, q):
        return q @ self.cross.transpose(-1, -2)

m = Shared().eval()
class Enc(torch.nn.Module):
    def __init__(s, m): super().__init__(); s.m = m
    def forward(s, feats): return s.m.encode(feats)
class Dec(torch.nn.Module):
    def __init__(s, m): super().__init__(); s.m = m
    def forward(s, q): return s.m.decode(q)
enc = torch.export.export(Enc(m), (torch.randn(1, 8, 16),), strict=True)
dec = torch.export.export(Dec(m), (torch.randn(1, 1, 16),), strict=True)
print("enc mutations", enc.graph_signature.buffers_to_mutate, [s.kind.name for s in enc.graph_signature.input_specs])
print("dec inputs", [(s.kind.name, s.target) for s in dec.graph_signature.input_specs])
edge = to_edge_transform_and_lower({"encode": enc, "decode": dec}, partitioner=[XnnpackPartitioner()])
prog = edge.to_executorch(ExecutorchBackendConfig(emit_mutable_buffer_names=True, memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False, share_mutable_buffers=True)))
open("mm.pte", "wb").write(prog.buffer)
from executorch.runtime import Runtime
p = Runtime.get().load_program("mm.pte")
e, d = p.load_method("encode"), p.load_method("decode")
feats, q = torch.randn(1, 8, 16), torch.randn(1, 1, 16)
e.execute([feats])
(out,) = d.execute([q])
with torch.no_grad():
    m.encode(feats); ref = m.decode(q)
print("shared? max err", (out - ref).abs().max().item(), "ref mag", ref.abs().max().item())
