"""A tiny Llama written as a GGUF file with the gguf package's writer, the way llama.cpp's
converter lays one out: its weights under llama.cpp's tensor names (the query and key
projections' rows reordered for llama.cpp's rotary layout, which transformers undoes when it
reads them), float32 or quantized to llama.cpp's types per tensor, a byte-level BPE vocabulary
of 256 bytes, three special tokens and one merge that text never meets, and a chat template."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID = 257, 258  # <|im_start|>, <|im_end|>
# One merge, of two bytes that UTF-8 text never holds (0xFE, 0xFF), so that every byte of a text
# stays a token of its own: llama.cpp refuses a byte-level vocabulary without merges.
MERGE = ("þ", "ÿ")
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + 1
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Per layer: llama.cpp's tensor name -> transformers' module, under model.layers.N.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def chat_job(path: Path) -> tuple[str, ...]:
    """The overrides of an eager job of the GGUF file `path` with a static cache of 32 slots,
    prefills up to 24 tokens, and a greedy answer to a chat prompt."""
    return (
        "backend=eager",
        "model=hf",
        f"model.checkpoint={path}",
        "model.kv_cache=static",
        "dynamic.seq.max=24",
        "model.max_cache_len=32",
        "validate.prompt=Hi",
    )


def tiny_llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    """Two layers, grouped-query heads, 128 positions, untied output: a job in seconds."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=128,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    return transformers.LlamaForCausalLM(config).eval()


def write(
    model: transformers.LlamaForCausalLM, path: Path, types: Mapping[str, str] | None = None
) -> Path:
    """`model` as the GGUF file `path`, with the tokenizer above; `types`: llama.cpp's type of
    each tensor named (`blk.0.attn_q.weight`: "Q4_1"), float32 for the others. Q4_0, Q4_1, Q5_0,
    Q5_1 and Q8_0 round the weight as llama.cpp does (the gguf package's quantizer); types it
    cannot quantize (the K-quants) are written as random blocks of their layout with small
    scales, a weight transformers reads as it would a real one."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config.hidden_size // heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(writer)
    weights = {name: tensor.detach().float().numpy() for name, tensor in model.state_dict().items()}
    tensors = {
        "token_embd.weight": weights["model.embed_tokens.weight"],
        "output_norm.weight": weights["model.norm.weight"],
        "output.weight": weights["lm_head.weight"],
    }
    for layer in range(config.num_hidden_layers):
        for gguf_name, module in _LAYER_TENSORS.items():
            weight = weights[f"model.layers.{layer}.{module}.weight"]
            if gguf_name == "attn_q":
                weight = _rotary_layout(weight, heads)
            elif gguf_name == "attn_k":
                weight = _rotary_layout(weight, kv_heads)
            tensors[f"blk.{layer}.{gguf_name}.weight"] = weight
    rng = np.random.default_rng(0)
    for name, weight in tensors.items():
        kind = (types or {}).get(name)
        if kind is None:
            writer.add_tensor(name, weight)
            continue
        qtype = gguf.GGMLQuantizationType[kind]
        raw = (
            gguf.quants.quantize(weight, qtype)
            if kind in _QUANTIZED_BY_GGUF
            else random_blocks(weight.shape, kind, rng)
        )
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# The types the gguf package's quantizer rounds a float32 weight to.
_QUANTIZED_BY_GGUF = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# Byte offsets and widths of each K-quant block's float16 scales, set small so that the random
# weights stay finite and of a model's size.
_HALF_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,)}


def random_blocks(shape: tuple[int, ...], kind: str, rng: np.random.Generator) -> np.ndarray:
    """Random bytes in the block layout of `kind` for a weight of `shape` [rows, cols], each
    block's float16 scales drawn in [1e-3, 2e-3)."""
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in _HALF_FIELDS[kind]:
        scales = rng.uniform(1e-3, 2e-3, size=raw.shape[:2]).astype(np.float16)
        raw[..., offset : offset + 2] = scales.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def _rotary_layout(weight: np.ndarray, heads: int) -> np.ndarray:
    """Each head's rows from transformers' halves layout (all first halves of the rotary pairs,
    then all second halves) to llama.cpp's interleaved pairs."""
    rows = weight.shape[0] // heads
    return (
        weight.reshape(heads, 2, rows // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _add_tokenizer(writer: gguf.GGUFWriter) -> None:
    tokens = [*_byte_symbols(), *SPECIAL_TOKENS, "".join(MERGE)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.NORMAL] * 256
        + [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS)
        + [gguf.TokenType.NORMAL]
    )
    writer.add_token_merges([" ".join(MERGE)])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def _byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: each byte as one printable character, the printable Latin-1
    ones as themselves and the rest shifted past 255."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    symbols, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + shifted)
            shifted += 1
    return [symbols[byte] for byte in range(256)]
