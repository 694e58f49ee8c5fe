# Spike (issue 43): WhisperCacheLM as one AOTInductor package with "encode" and "model"
# models compiled from programs over the same tensors (CPU, torch 2.14.1): their caches are
# shared at load; encode within 7.2e-7 of eager, a prefill and 4 decode steps within 7e-8.
import sys, time, torch
sys.path.insert(0, ".")
from transformers import WhisperConfig, WhisperForConditionalGeneration
from exporter.models.hf_speech import WhisperCacheLM
from torch._inductor import aot_compile
from torch._inductor.package import package_aoti
from torch.export.pt2_archive._package import load_pt2
import ctypes, ctypes.util, os
ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6", mode=os.RTLD_GLOBAL)
torch.manual_seed(0)
cfg = WhisperConfig(vocab_size=96, num_mel_bins=80, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=1500, max_target_positions=32, pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=1)
w = WhisperCacheLM(WhisperForConditionalGeneration(cfg).eval(), 16).eval()
feats = torch.randn(1, 80, 3000); toks = torch.randint(0, 96, (1, 9))
seq = torch.export.Dim("seq", min=1, max=16)
enc = torch.export.export(w.encoder_view(), (feats,), strict=True)
dec = torch.export.export(w, (toks[:, :5], torch.arange(5)), dynamic_shapes=({1: seq}, {0: seq}), strict=True)
opts = {"aot_inductor.package_constants_in_so": False, "aot_inductor.package_constants_on_disk_format": "pickle_weights", "aot_inductor.package": True}
t = time.time()
files = {name: aot_compile(p.module(check_guards=False), *p.example_inputs, options=dict(opts)) for name, p in (("model", dec), ("encode", enc))}
package_aoti("/tmp/waoti/w.pt2", files); print("compiled", time.time() - t)
with torch.no_grad():
    for b in w.buffers(): b.zero_()
    ref_h = w.encode(feats); ref = [w(toks[:, :5], torch.arange(5))] + [w(toks[:, i:i+1], torch.tensor([i])) for i in range(5, 9)]
r = load_pt2("/tmp/waoti/w.pt2", load_weights_from_disk=True).aoti_runners
h = r["encode"](feats)
outs = [r["model"](toks[:, :5], torch.arange(5))] + [r["model"](toks[:, i:i+1], torch.tensor([i])) for i in range(5, 9)]
h = h[0] if isinstance(h, (list, tuple)) else h
outs = [o[0] if isinstance(o, (list, tuple)) else o for o in outs]
print("encode", (h - ref_h).abs().max().item(), "steps", [round((o - r_).abs().max().item(), 8) for o, r_ in zip(outs, ref)])
