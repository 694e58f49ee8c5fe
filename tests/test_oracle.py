"""The float64 oracle widens one module's weights at a time: the same outputs as a float64 copy
of the model, without holding one."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from exporter.validate import quantized_layers
from exporter.validate.oracle import float64_weights


def tiny_llama(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=128,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def float64_elements(model: torch.nn.Module) -> int:
    seen = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    # The swapped-in copies live in the modules' own tables, which parameters() walks.
    return sum(t.numel() for t in seen.values() if t.dtype == torch.float64)


def test_layer_by_layer_gives_the_float64_copys_logits_and_leaves_the_model_as_it_was() -> None:
    model = tiny_llama(torch.bfloat16)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = copy.deepcopy(model).to(torch.float64)(input_ids=ids).logits
        with float64_weights(model):
            logits = model(input_ids=ids).logits
    assert logits.dtype == torch.float64
    assert torch.equal(logits, expected)
    after = model.state_dict()
    assert all(
        torch.equal(after[name], t) and after[name].dtype == t.dtype for name, t in before.items()
    )
    # The hooks are gone: the model runs in its own dtype again.
    with torch.no_grad():
        assert model(input_ids=ids).logits.dtype == torch.bfloat16


def test_at_most_one_modules_weights_are_float64_at_any_time() -> None:
    model = tiny_llama(torch.float32)
    largest_own = max(sum(t.numel() for t in m.parameters(recurse=False)) for m in model.modules())
    peaks = []
    for module in model.modules():
        module.register_forward_hook(lambda *_: peaks.append(float64_elements(model)))
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), float64_weights(model):
        model(input_ids=ids)
    # A whole float64 copy would be every parameter; here the tied embedding (the largest
    # module's own weights, widened once by the embedding, once by the head) is the most.
    total = sum(t.numel() for t in model.parameters())
    assert 0 < max(peaks) <= largest_own < total / 2
    assert float64_elements(model) == 0


def test_a_linear_layer_widened_in_slices_of_rows_gives_the_float64_layers_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 100 rows of 64 inputs in slices of 24 rows: five slices, the last one short.
    monkeypatch.setattr(quantized_layers, "SLICE_ELEMENTS", 24 * 64)
    torch.manual_seed(3)
    layer = torch.nn.Linear(64, 100).to(torch.bfloat16)
    x = torch.randn(2, 7, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = copy.deepcopy(layer).to(torch.float64)(x.to(torch.float64))
        with float64_weights(layer):
            sliced = layer(x)
    assert sliced.dtype == torch.float64
    torch.testing.assert_close(sliced, expected, rtol=1e-13, atol=1e-13)
    assert "forward" not in vars(layer) and layer.weight.dtype == torch.bfloat16
