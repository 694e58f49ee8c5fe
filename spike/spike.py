import time, torch, transformers as T
from transformers.integrations.executorch import Seq2SeqLMDecoderExportableModuleWithStaticCache
torch.manual_seed(0)
cfg = T.WhisperConfig(vocab_size=200, num_mel_bins=80, encoder_layers=2, encoder_attention_heads=2, decoder_layers=2,
    decoder_attention_heads=2, d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=1500,
    max_target_positions=64, decoder_start_token_id=1, eos_token_id=2, pad_token_id=0, bos_token_id=1)
model = T.WhisperForConditionalGeneration(cfg).eval()
feats = torch.randn(1, 80, 3000)
class Enc(torch.nn.Module):
    def __init__(s, e): super().__init__(); s.e=e
    def forward(s, input_features): return s.e(input_features=input_features).last_hidden_state
t=time.time()
enc = torch.export.export(Enc(model.get_encoder()), (feats,), strict=True)
print("encoder exported", time.time()-t)
model.lm_head = model.proj_out
dec_mod = Seq2SeqLMDecoderExportableModuleWithStaticCache(model, max_static_cache_length=64, batch_size=1).eval()
hs = Enc(model.get_encoder())(feats)
t=time.time()
try:
    dec = torch.export.export(dec_mod, (torch.tensor([[1]]), hs, torch.tensor([0])), strict=True)
    print("decoder exported", time.time()-t)
except Exception as e:
    print("decoder FAIL", type(e).__name__, str(e)[:800]); raise SystemExit
# eager greedy with transformers
with torch.no_grad():
    ref = model.generate(input_features=feats, max_new_tokens=10, do_sample=False)
print("transformers generate", ref.tolist())
from executorch.exir import to_edge_transform_and_lower
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
t=time.time()
prog = to_edge_transform_and_lower({"encoder": enc, "text_decoder": dec}, partitioner=[XnnpackPartitioner()]).to_executorch()
open("/tmp/wsp/whisper.pte","wb").write(prog.buffer); print("lowered", time.time()-t)
from executorch.runtime import Runtime
rt = Runtime.get(); p = rt.load_program("/tmp/wsp/whisper.pte")
e = p.load_method("encoder"); d = p.load_method("text_decoder")
(h,) = e.execute([feats])
print("enc err", (h-hs).abs().max().item())
tok=[1]; 
for i in range(9):
    (logits,) = d.execute([torch.tensor([[tok[-1]]]), h, torch.tensor([i])])
    tok.append(int(logits[0,-1].argmax()))
    if tok[-1]==2: break
print("pte greedy", tok)
