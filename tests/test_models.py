"""Model builders: seeded random weights, and real loading of a local Hugging Face checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig as HfLlamaConfig
from transformers import LlamaForCausalLM

from exporter import models
from exporter.cache import keys
from exporter.config import CustomModelConfig, DimBounds, LlamaConfig, MlpConfig
from exporter.errors import ConfigError
from tests.conftest import CliResult

SEQ = {"seq": DimBounds(min=1, max=16)}


def small_llama(**overrides: object) -> LlamaConfig:
    fields = dict(
        name="llama",
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=128,
        max_position_embeddings=64,
    )
    return LlamaConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    torch.manual_seed(7)
    hf_config = HfLlamaConfig(
        hidden_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=200,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(hf_config).eval()
    directory = tmp_path_factory.mktemp("checkpoint")
    model.save_pretrained(directory)
    return directory, model


def test_random_weights_are_seeded() -> None:
    first = models.build(small_llama(seed=1), SEQ).module.state_dict()
    again = models.build(small_llama(seed=1), SEQ).module.state_dict()
    other = models.build(small_llama(seed=2), SEQ).module.state_dict()
    key = "model.model.layers.0.mlp.up_proj.weight"
    assert torch.equal(first[key], again[key])
    assert not torch.equal(first[key], other[key])


def test_a_custom_factory_draws_its_random_weights_from_the_model_seed() -> None:
    def weight(seed: int) -> torch.Tensor:
        cfg = CustomModelConfig(
            name="custom", seed=seed, factory="tests.failing_models:fixed_batch"
        )
        cfg.options = {"rows": 8}
        # FixedBatch draws its bias with torch.randn, from the global generator.
        return models.build(cfg, {"batch": DimBounds(min=1, max=8)}).module.bias

    assert torch.equal(weight(1), weight(1))
    assert not torch.equal(weight(1), weight(2))


def test_files_a_model_is_read_from_key_its_cache_entries(checkpoint, tmp_path: Path) -> None:
    directory, _ = checkpoint
    assert directory / "config.json" in keys.checkpoint_files(
        small_llama(checkpoint=str(directory))
    )
    assert keys.checkpoint_files(small_llama()) == []
    by_module = CustomModelConfig(name="custom", factory="tests.failing_models:fixed_batch")
    assert "tests/failing_models.py" in keys.model_code(by_module)["sources"]
    script = tmp_path / "mine.py"
    helper = tmp_path / "helper.py"
    script.write_text("from helper import LAYERS\n\ndef declare(): ...\n")
    helper.write_text("LAYERS = 2\n")
    by_file = CustomModelConfig(name="custom", factory=f"{script}:declare")
    before = keys.model_code(by_file)
    assert {"mine.py", "helper.py"} <= set(before["sources"])
    helper.write_text("LAYERS = 3\n")
    assert keys.model_code(by_file) != before


def test_a_models_code_is_its_builder_and_the_libraries_it_imports() -> None:
    mlp, llama = keys.model_code(MlpConfig(name="mlp")), keys.model_code(small_llama())
    assert "exporter/models/mlp.py" in mlp["sources"]
    assert "exporter/models/llama.py" not in mlp["sources"]
    assert "transformers" in llama["libraries"] and "transformers" not in mlp["libraries"]


def test_token_ids_are_drawn_in_vocabulary_range() -> None:
    bundle = models.build(small_llama(), SEQ)
    (ids,) = bundle.make_inputs({"seq": 16}, 3)
    assert ids.shape == (1, 16)
    assert ids.dtype == torch.int64
    assert int(ids.min()) >= 0 and int(ids.max()) < 128
    assert torch.equal(ids, bundle.make_inputs({"seq": 16}, 3)[0])


def test_checkpoint_loads_the_saved_weights_and_shape(checkpoint) -> None:
    directory, saved = checkpoint
    bundle = models.build(small_llama(checkpoint=str(directory)), SEQ)
    (ids,) = bundle.make_inputs({"seq": 5}, 0)
    assert int(ids.max()) < 200
    with torch.no_grad():
        assert torch.equal(bundle.module(ids), saved(input_ids=ids, use_cache=False).logits)


def test_checkpoint_limits_the_bounds_to_its_max_positions(checkpoint) -> None:
    directory, _ = checkpoint
    with pytest.raises(ConfigError, match=r"beyond what model 'llama' supports \(32\)"):
        models.build(small_llama(checkpoint=str(directory)), {"seq": DimBounds(1, 33)})


def test_a_directory_without_config_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no config\.json"):
        models.build(small_llama(checkpoint=str(tmp_path)), SEQ)


def test_checkpoint_job_runs_from_the_command_line(
    checkpoint, exporter_cli: Callable[..., CliResult]
) -> None:
    directory, _ = checkpoint
    result = exporter_cli(
        "model=llama", f"model.checkpoint={directory}", "backend=eager", "dynamic.seq.max=32"
    )
    assert result.exit_code == 0, result.output
    (run,) = result.mlflow_runs()
    assert run.data.params["model.checkpoint"] == str(directory)
    assert result.report()["passed"]


def test_weight_bytes_count_tied_weights_and_buffers_once() -> None:
    embedding = torch.nn.Embedding(100, 8)
    head = torch.nn.Linear(8, 100, bias=False)
    head.weight = embedding.weight
    module = torch.nn.Sequential(embedding, head)
    module.register_buffer("scale", torch.ones(4, dtype=torch.float64))
    # A second parameter object over the same storage (as a checkpoint loader may make).
    module.register_parameter("alias", torch.nn.Parameter(embedding.weight.data))
    assert models.weight_bytes(module) == 100 * 8 * 4 + 4 * 8


def test_a_llama_with_tied_embeddings_weighs_one_embedding_less() -> None:
    untied = models.build(small_llama(), SEQ).module
    tied = models.build(small_llama(tie_word_embeddings=True), SEQ).module
    parameters = {id(p): p.numel() * p.element_size() for p in untied.parameters()}
    assert models.weight_bytes(untied) >= sum(parameters.values())
    assert models.weight_bytes(untied) - models.weight_bytes(tied) == 128 * 32 * 4
