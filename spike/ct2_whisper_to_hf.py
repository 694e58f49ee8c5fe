# Convert CTranslate2 Whisper model.bin (float16) -> transformers WhisperForConditionalGeneration
import sys, json, os, numpy as np, torch
sys.path.insert(0, os.path.dirname(__file__)); from ct2read import read
src, dst = sys.argv[1], sys.argv[2]
_,_,_,V,al = read(os.path.join(src,'model.bin'))
W = lambda k: torch.from_numpy(V[k][0].astype(np.float32).copy())
from transformers import WhisperConfig, WhisperForConditionalGeneration
d = V['encoder/conv1/weight'][0].shape[0]; nmel = V['encoder/conv1/weight'][0].shape[1]
ne = len({k.split('/')[1] for k in V if k.startswith('encoder/layer_') and k.split('/')[1][6:].isdigit()})
nd = len({k.split('/')[1] for k in V if k.startswith('decoder/layer_') and k.split('/')[1][6:].isdigit()})
vocab = V['decoder/embeddings/weight'][0].shape[0]; heads = int(V['encoder/num_heads'][0][0])
en = vocab == 51864
cfg = WhisperConfig(vocab_size=vocab, num_mel_bins=nmel, d_model=d, encoder_layers=ne, decoder_layers=nd,
    encoder_attention_heads=heads, decoder_attention_heads=int(V['decoder/num_heads'][0][0]),
    encoder_ffn_dim=V['encoder/layer_0/ffn/linear_0/weight'][0].shape[0], decoder_ffn_dim=V['decoder/layer_0/ffn/linear_0/weight'][0].shape[0],
    max_source_positions=V['encoder/position_encodings/encodings'][0].shape[0], max_target_positions=V['decoder/position_encodings/encodings'][0].shape[0],
    bos_token_id=50256 if en else 50257, eos_token_id=50256 if en else 50257, pad_token_id=50256 if en else 50257,
    decoder_start_token_id=50257 if en else 50258)
m = WhisperForConditionalGeneration(cfg).eval()
sd = {}
def attn(prefix, ct, fused_qkv):
    if fused_qkv:
        w = W(ct+'/linear_0/weight'); b = W(ct+'/linear_0/bias'); q,k,v = w.chunk(3); qb,kb,vb = b.chunk(3)
        sd.update({prefix+'q_proj.weight':q, prefix+'q_proj.bias':qb, prefix+'k_proj.weight':k, prefix+'v_proj.weight':v, prefix+'v_proj.bias':vb})
        o = ct+'/linear_1'
    else:  # cross-attn: linear_0=q, linear_1=kv, linear_2=out
        sd.update({prefix+'q_proj.weight':W(ct+'/linear_0/weight'), prefix+'q_proj.bias':W(ct+'/linear_0/bias')})
        k,v = W(ct+'/linear_1/weight').chunk(2); kb,vb = W(ct+'/linear_1/bias').chunk(2)
        sd.update({prefix+'k_proj.weight':k, prefix+'v_proj.weight':v, prefix+'v_proj.bias':vb}); o = ct+'/linear_2'
    sd[prefix+'out_proj.weight']=W(o+'/weight'); sd[prefix+'out_proj.bias']=W(o+'/bias')
def ln(p, ct): sd[p+'weight']=W(ct+'/gamma'); sd[p+'bias']=W(ct+'/beta')
def ffn(p, ct):
    sd[p+'fc1.weight']=W(ct+'/linear_0/weight'); sd[p+'fc1.bias']=W(ct+'/linear_0/bias')
    sd[p+'fc2.weight']=W(ct+'/linear_1/weight'); sd[p+'fc2.bias']=W(ct+'/linear_1/bias'); ln(p+'final_layer_norm.', ct+'/layer_norm')
E='model.encoder.'; D='model.decoder.'
for c in ('conv1','conv2'): sd[E+c+'.weight']=W(f'encoder/{c}/weight'); sd[E+c+'.bias']=W(f'encoder/{c}/bias')
sd[E+'embed_positions.weight']=W('encoder/position_encodings/encodings'); ln(E+'layer_norm.','encoder/layer_norm')
for i in range(ne):
    p=f'{E}layers.{i}.'; c=f'encoder/layer_{i}'
    attn(p+'self_attn.', c+'/self_attention', True); ln(p+'self_attn_layer_norm.', c+'/self_attention/layer_norm')
    ffn(p, c+'/ffn')
sd[D+'embed_tokens.weight']=W('decoder/embeddings/weight'); sd[D+'embed_positions.weight']=W('decoder/position_encodings/encodings'); ln(D+'layer_norm.','decoder/layer_norm')
for i in range(nd):
    p=f'{D}layers.{i}.'; c=f'decoder/layer_{i}'
    attn(p+'self_attn.', c+'/self_attention', True); ln(p+'self_attn_layer_norm.', c+'/self_attention/layer_norm')
    attn(p+'encoder_attn.', c+'/attention', False); ln(p+'encoder_attn_layer_norm.', c+'/attention/layer_norm')
    ffn(p, c+'/ffn')
sd['proj_out.weight']=sd[D+'embed_tokens.weight']
missing, unexpected = m.load_state_dict(sd, strict=False)
print('missing', missing, 'unexpected', unexpected)
m.save_pretrained(dst)
from transformers import WhisperFeatureExtractor, WhisperTokenizerFast, WhisperProcessor
tok = WhisperTokenizerFast(tokenizer_file=os.path.join(src,'tokenizer.json'))
fe = WhisperFeatureExtractor(feature_size=nmel)
WhisperProcessor(feature_extractor=fe, tokenizer=tok).save_pretrained(dst)
print('saved', dst)
# Whisper-specific generation config from the CT2 config.json
from transformers import GenerationConfig
c = json.load(open(os.path.join(src,'config.json')))
g = GenerationConfig.from_pretrained(dst)
g.suppress_tokens = c.get('suppress_ids', []); g.begin_suppress_tokens = c.get('suppress_ids_begin', [220, cfg.eos_token_id])
g.alignment_heads = c.get('alignment_heads'); g.is_multilingual = not en; g.max_length = cfg.max_target_positions
g.no_timestamps_token_id = tok.convert_tokens_to_ids('<|notimestamps|>'); g.forced_decoder_ids = None
g.save_pretrained(dst); print('generation_config written')
