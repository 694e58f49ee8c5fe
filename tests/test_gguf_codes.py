"""A GGUF checkpoint's quantized tensors as the model gets them (exporter/models/gguf_codes.py):
the codes of each type read dequantize to exactly what the gguf package's own dequantization
gives, in transformers' row order; the packed layers of quantize=auto hold the codes exactly,
their scales rounded to bfloat16 (the file's weights exactly where the scales survive that);
a type no kernel holds is planned from its dequantized weight, no coarser than the file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from exporter.models import gguf_codes
from exporter.models.gguf_codes import StoredCodes
from exporter.quantize import float64_ops, plan, recipes
from exporter.quantize.packed import PackedEmbedding, PackedLinear
from tests import gguf_checkpoint

# One tensor of each type the reader takes, and one it does not (Q5_K); K-quants need rows of
# 256, so the model is 256 wide.
TYPES = {
    "blk.0.attn_q.weight": "Q4_0",
    "blk.0.attn_k.weight": "Q4_1",
    "blk.0.attn_v.weight": "Q8_0",
    "blk.0.attn_output.weight": "Q4_K",
    "blk.0.ffn_gate.weight": "Q6_K",
    "blk.0.ffn_up.weight": "Q5_K",
    "blk.0.ffn_down.weight": "Q4_K",
    "token_embd.weight": "Q8_0",
}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, transformers.PreTrainedModel]:
    """The GGUF file, and the model transformers loads from it (its weights dequantized)."""
    config = transformers.LlamaConfig(
        hidden_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        vocab_size=gguf_checkpoint.VOCAB_SIZE,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    path = gguf_checkpoint.write(model, tmp_path_factory.mktemp("gguf") / "mixed.gguf", TYPES)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent,
        gguf_file=path.name,
        dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True),
    )
    return path, loaded.eval()


def test_every_type_read_dequantizes_exactly_as_the_gguf_package_does(written) -> None:
    path, model = written
    read = gguf_codes.read(path, model)
    assert read.types() == {"Q4_0": 1, "Q4_1": 1, "Q8_0": 2, "Q4_K": 2, "Q6_K": 1}
    (skipped,) = read.not_carried
    assert (skipped.tensor, skipped.ggml_type) == ("blk.0.ffn_up.weight", "Q5_K")
    reader = gguf.GGUFReader(path)
    heads = model.config.num_attention_heads, model.config.num_key_value_heads
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in gguf_codes.READ_TYPES:
            continue
        expected = gguf.dequantize(tensor.data, tensor.tensor_type)
        # The file's query and key rows are in llama.cpp's rotary layout; transformers' are not.
        if tensor.name.endswith("attn_q.weight"):
            expected = _halves_layout(expected, heads[0])
        elif tensor.name.endswith("attn_k.weight"):
            expected = _halves_layout(expected, heads[1])
        name = {v: k for k, v in _names(model).items()}[tensor.name]
        stored = read.codes[name]
        assert stored.ggml_type == kind
        assert torch.equal(stored.dequantized(), torch.from_numpy(expected)), tensor.name


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K"])
def test_a_packed_layer_holds_the_files_codes_exactly_and_its_scales_in_bfloat16(
    written, kind: str
) -> None:
    path, model = written
    stored = _stored(path, model, kind)
    rows, cols = stored.shape
    layer = torch.nn.Linear(cols, rows, bias=False)
    recipe = recipes.RECIPES["int8" if stored.bits == 8 else "int4"]
    assert recipe.holds(stored)
    packed = recipe.quantized(layer, stored)
    assert isinstance(packed, PackedLinear)
    # The kernel's codes are counted from 0: a plane per 4 bits.
    if stored.bits == 4:
        lowest = -8 if stored.signed else 0
        assert torch.equal(packed.planes[0].codes().to(torch.int8), stored.codes - lowest)
    else:
        counted = stored.codes.to(torch.int32) + 128
        assert torch.equal(packed.planes[0].codes().to(torch.int32), counted >> 4)
        assert torch.equal(packed.planes[1].codes().to(torch.int32), counted & 0x0F)
    # Its scales and zeros: the file's, rounded to bfloat16 (the zero as the kernel takes it:
    # w = (u - 8) * s + z).
    shift = 8 if stored.bits == 8 else 8 + (-8 if stored.signed else 0)
    scale, zero = packed.planes[-1].scales()
    assert torch.equal(scale, stored.scale.to(torch.bfloat16))
    assert torch.equal(zero, (stored.offset + shift * stored.scale).to(torch.bfloat16))
    assert not torch.equal(packed.dequantized(), stored.dequantized())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K"])
def test_where_the_scales_survive_bfloat16_the_packed_weight_is_the_files(
    written, kind: str
) -> None:
    path, model = written
    stored = _stored(path, model, kind)
    exact = _with_scales(stored)
    rows, cols = exact.shape
    packed = recipes.RECIPES["int8" if exact.bits == 8 else "int4"].quantized(
        torch.nn.Linear(cols, rows, bias=False), exact
    )
    assert torch.equal(packed.dequantized(), exact.dequantized())
    # A tied embedding looks its rows up in the same table, exactly.
    ids = torch.tensor([[0, 63, 64, rows - 1]])
    looked_up = PackedEmbedding(packed, torch.float32)(ids)[0]
    assert torch.equal(looked_up, exact.dequantized()[ids[0]])


def test_the_packed_matmul_in_float64_is_the_layers_own_arithmetic(written) -> None:
    """Localization's float64 run of a program calls the packed kernel's float64 stand-in; the
    oracle calls the layer's: both widen the stored codes, scales and zeros."""
    path, model = written
    stored = _stored(path, model, "Q8_0")
    rows, cols = stored.shape
    layer = recipes.RECIPES["int8"].quantized(torch.nn.Linear(cols, rows, bias=False), stored)
    x = torch.randn(3, cols, dtype=torch.float64)
    stand_in = float64_ops.float64_op(torch.ops.aten._weight_int4pack_mm_for_cpu.default)
    assert stand_in is not None
    planes = [
        stand_in(x, plane.packed, plane.group, plane.scales_and_zeros.to(torch.float64))
        for plane in layer.planes
    ]
    torch.testing.assert_close(sum(planes), layer.float64(x), rtol=1e-12, atol=1e-12)
    # And the kernel itself, in bfloat16, within bfloat16's rounding of its input and output.
    torch.testing.assert_close(layer(x.float()).double(), layer.float64(x), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_an_output_projection_ranks_its_largest_outputs_by_the_files_own_weight(
    written, kind: str
) -> None:
    """The kernel's bfloat16 output rounds a logit of 25 to 0.125; an output projection computes
    its largest outputs again with the file's scales, not rounded to bfloat16."""
    path, model = written
    stored = _stored(path, model, kind)
    rows, cols = stored.shape
    recipe = recipes.RECIPES["int8" if stored.bits == 8 else "int4"]
    layer = recipe.quantized(torch.nn.Linear(cols, rows, bias=False), stored, logits=True)
    x = torch.randn(5, cols) * 30
    out = layer(x)
    files = x.double() @ stored.dequantized().double().T
    top = out.topk(recipes.EXACT_TOP, dim=-1).indices
    # float32 products of the file's weights, summed: within float32's rounding.
    torch.testing.assert_close(
        out.gather(-1, top).double(), files.gather(-1, top), rtol=1e-5, atol=1e-4
    )
    assert torch.equal(out.argmax(-1), files.argmax(-1))
    # The rest as the kernel gives them, and the oracle on the file's weight whole.
    plain = recipe.quantized(torch.nn.Linear(cols, rows, bias=False), stored)
    rest = torch.ones_like(out, dtype=torch.bool).scatter(-1, top, False)
    assert torch.equal(out[rest], plain(x)[rest])
    torch.testing.assert_close(layer.float64(x.double()), files, rtol=1e-12, atol=1e-9)


def test_a_type_no_kernel_holds_is_planned_from_its_weight_no_coarser_than_the_file(
    written,
) -> None:
    path, model = written
    read = gguf_codes.read(path, model)
    by_layer = read.by_layer(model)
    planned = {
        unit.name: unit for unit in plan.units(model, ("int4", "int8", "float"), by_layer, skip=())
    }
    gate = planned["model.layers.0.mlp.gate_proj"]
    assert gate.stored is not None and gate.stored.ggml_type == "Q6_K"
    # 6-bit codes: int4 would round them more coarsely than the file did.
    assert [r.name for r in gate.candidates] == ["int8", "float"]
    # Where a recipe holds the file's codes: that one, or float.
    assert [r.name for r in planned["model.layers.0.self_attn.q_proj"].candidates] == [
        "int4",
        "float",
    ]
    assert [r.name for r in planned["model.layers.0.self_attn.v_proj"].candidates] == [
        "int8",
        "float",
    ]
    # A weight whose codes were not read (Q5_K) is planned as a float one: any recipe.
    up = planned["model.layers.0.mlp.up_proj"]
    assert up.stored is None
    assert [r.name for r in up.candidates] == ["int4", "int8", "float"]
    # A table of 260 rows fits no packing (rows in blocks of 64): nothing to plan.
    assert "lm_head" not in planned and "model.embed_tokens" not in planned


def _stored(path: Path, model: transformers.PreTrainedModel, kind: str) -> StoredCodes:
    """The file's weight of type `kind` that packs (rows in blocks of 64: not the embedding)."""
    read = gguf_codes.read(path, model)
    return next(s for s in read.codes.values() if s.ggml_type == kind and s.shape[0] % 64 == 0)


def _with_scales(stored: StoredCodes) -> StoredCodes:
    """`stored` with scales and offsets that bfloat16 holds as the packed kernel reads them: the
    scale rounded, and the zero it takes (offset + shift * scale) rounded, the offset following
    from both."""
    shift = 8 if stored.bits == 8 else 8 + (-8 if stored.signed else 0)
    scale = stored.scale.to(torch.bfloat16).to(torch.float32)
    zero = (stored.offset + shift * scale).to(torch.bfloat16).to(torch.float32)
    return StoredCodes(
        stored.ggml_type, stored.bits, stored.group, stored.codes, scale, zero - shift * scale
    )


def _names(model: transformers.PreTrainedModel) -> dict[str, str]:
    """The model's weight names and llama.cpp's for them."""
    names = {"model.embed_tokens.weight": "token_embd.weight"}
    layer = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for index in range(model.config.num_hidden_layers):
        for ours, theirs in layer.items():
            names[f"model.layers.{index}.{ours}.weight"] = f"blk.{index}.{theirs}.weight"
    return names


def _halves_layout(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's interleaved rotary rows back to transformers' halves."""
    rows = weight.shape[0] // heads
    return weight.reshape(heads, rows // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)
