"""model=hf: tiny checkpoints of several architectures, saved by transformers' own classes, through
the builder and through the whole job; and the checkpoints it refuses."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import PretrainedConfig, PreTrainedModel

from exporter import models
from exporter.config import DimBounds, HfConfig, KvCache, ModelDtype
from exporter.errors import ConfigError
from exporter.models import DynamicDim
from exporter.validate.plan import plan
from tests.conftest import PROJECT_ROOT, CliResult, command_line, job_in_process
from tests.test_cli import assert_user_error
from tests.test_models import small_llama

SEQ = {"seq": DimBounds(min=1, max=128)}

# Small enough for a job in seconds; 128 positions, so that dynamic=hf's seq 1..128 fits. One
# decoder layer: what differs between architectures is inside each layer, and a second one
# doubles export and every load of the exported program. GPT-2 keeps two, so that its static
# cache job has a layer's cache to mix up with another's.
DECODER = dict(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    vocab_size=256,
    max_position_embeddings=128,
)


@dataclass(frozen=True)
class Architecture:
    config: type[PretrainedConfig]
    model: type[PreTrainedModel]
    fields: dict[str, Any]
    # What the builder picks: sdpa where the class has it.
    attention: str = "sdpa"


ARCHITECTURES = {
    "llama": Architecture(transformers.LlamaConfig, transformers.LlamaForCausalLM, DECODER),
    "qwen2": Architecture(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, DECODER),
    "qwen3": Architecture(
        transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {**DECODER, "head_dim": 8}
    ),
    "mistral": Architecture(transformers.MistralConfig, transformers.MistralForCausalLM, DECODER),
    # Gemma's defaults: a head_dim of its own, tied embeddings, a padding id inside the vocab.
    "gemma": Architecture(
        transformers.GemmaConfig,
        transformers.GemmaForCausalLM,
        {**DECODER, "head_dim": 8, "pad_token_id": 0},
    ),
    # Softcapped logits and no sdpa: the class the builder gives eager attention.
    "gemma2": Architecture(
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        {**DECODER, "head_dim": 8, "pad_token_id": 0},
        attention="eager",
    ),
    "phi3": Architecture(
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        {**DECODER, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # Learned positions bounded by n_positions, fused qkv, LayerNorm, GELU.
    "gpt2": Architecture(
        transformers.GPT2Config,
        transformers.GPT2LMHeadModel,
        dict(n_embd=32, n_layer=2, n_head=4, n_positions=128, vocab_size=256),
    ),
}

# Every architecture's whole job runs by default on backend=eager: loading, export and validation
# at every planned shape are what differ between architectures, and eager adds no lowering to
# them. Through ExecuTorch a job takes 20-60 s per architecture; GPT-2 (its own layout: learned
# positions, fused qkv, LayerNorm, GELU) runs there by default, the rest with -m slow (the
# rotary decoders lower as model=llama does, which the default suite lowers often).
DEFAULT_EXECUTORCH_JOBS = {"gpt2"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The tiny checkpoint of an architecture, saved on first use with seeded random weights."""
    root = tmp_path_factory.mktemp("checkpoints")

    def saved(name: str) -> Path:
        directory = root / name
        if not directory.exists():
            architecture = ARCHITECTURES[name]
            torch.manual_seed(0)
            model = architecture.model(architecture.config(**architecture.fields))
            model.save_pretrained(directory)
        return directory

    return saved


def hf(directory: Path, **overrides: Any) -> HfConfig:
    return HfConfig(name="hf", checkpoint=str(directory), **overrides)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_builder_logits_are_the_architectures_own(name: str, checkpoints) -> None:
    directory = checkpoints(name)
    architecture = ARCHITECTURES[name]
    bundle = models.build(hf(directory), SEQ)
    wrapped = bundle.module.model
    assert type(wrapped) is architecture.model
    assert wrapped.config._attn_implementation == architecture.attention
    (ids,) = bundle.make_inputs({"seq": 37}, 0)
    assert int(ids.max()) < 256
    # As the float64 oracle makes it: loaded at the model's dtype, then cast.
    as_oracle = architecture.model.from_pretrained(directory, dtype=torch.float32)
    at_float64 = architecture.model.from_pretrained(directory, dtype=torch.float64)
    with torch.no_grad():
        built = bundle.module.to(torch.float64)(ids)
        assert built.shape == (1, 37, 256)
        assert torch.equal(built, as_oracle.to(torch.float64)(input_ids=ids).logits)
        # Gemma keeps sqrt(hidden_size), its embedding scale, in a buffer made at the dtype it
        # loads at: loaded at float32 and cast, it holds that constant rounded to float32.
        atol = 1e-6 if name.startswith("gemma") else 1e-12
        expected = at_float64(input_ids=ids).logits
        torch.testing.assert_close(built, expected, atol=atol, rtol=0)


@pytest.mark.parametrize(
    ("name", "backend"),
    [
        *((name, "eager") for name in sorted(ARCHITECTURES)),
        *(
            pytest.param(
                name,
                "executorch",
                marks=[] if name in DEFAULT_EXECUTORCH_JOBS else [pytest.mark.slow],
            )
            for name in sorted(ARCHITECTURES)
        ),
    ],
)
def test_job_exports_and_validates_each_architecture(
    name: str, backend: str, checkpoints, tmp_path: Path
) -> None:
    # In this process: what differs between architectures is what the stages compute; the
    # command itself is test_cli's to prove, and a fresh process adds ~5 s of imports per job.
    record, report = job_in_process(
        tmp_path / "run", "model=hf", f"model.checkpoint={checkpoints(name)}", f"backend={backend}"
    )
    assert record.exit_code == 0, record.error
    assert report["passed"]
    seq = DynamicDim("seq", (("input_ids", 1),), 1, 128)
    assert [shape["shape"]["seq"] for shape in report["shapes"]] == [
        shape["seq"] for shape in plan([seq], [], 2, seed=0)
    ]
    assert max(shape["max_abs"] for shape in report["shapes"]) < 1e-5


def test_weights_load_at_the_model_dtype(checkpoints) -> None:
    bundle = models.build(hf(checkpoints("qwen2"), dtype=ModelDtype.bfloat16), SEQ)
    assert {p.dtype for p in bundle.module.parameters()} == {torch.bfloat16}
    (ids,) = bundle.make_inputs({"seq": 4}, 0)
    with torch.no_grad():
        assert bundle.module(ids).dtype == torch.bfloat16


def test_seq_is_bounded_by_the_checkpoints_max_positions(checkpoints) -> None:
    # GPT-2 names them n_positions.
    with pytest.raises(ConfigError, match=r"beyond what model 'hf' supports \(128\)"):
        models.build(hf(checkpoints("gpt2")), {"seq": DimBounds(1, 129)})


def test_model_llama_points_other_checkpoints_to_model_hf(checkpoints) -> None:
    directory = checkpoints("qwen2")
    llama = small_llama(checkpoint=str(directory))
    with pytest.raises(ConfigError, match=rf"'qwen2'.*model=hf model\.checkpoint={directory}"):
        models.build(llama, SEQ)


def test_a_directory_without_config_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no config\.json"):
        models.build(hf(tmp_path), SEQ)


def test_a_config_without_weights_is_refused(tmp_path: Path) -> None:
    transformers.LlamaConfig(**DECODER).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"cannot load its weights"):
        models.build(hf(tmp_path), SEQ)


def test_weights_of_another_shape_are_refused(checkpoints, tmp_path: Path) -> None:
    saved = json.loads((checkpoints("llama") / "config.json").read_text())
    for file in checkpoints("llama").iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({**saved, "intermediate_size": 96}))
    with pytest.raises(ConfigError, match=r"cannot load its weights.*ignore_mismatched_sizes"):
        models.build(hf(tmp_path), SEQ)


def test_weights_that_lack_a_tensor_are_refused_not_drawn_at_random(checkpoints, tmp_path) -> None:
    # A headless Llama's weights under LlamaForCausalLM's names: all but lm_head.
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER)).model.save_pretrained(
        tmp_path
    )
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({**saved, "architectures": ["LlamaForCausalLM"]})
    )
    with pytest.raises(ConfigError, match=r"lack 1 of the model's tensors \(lm_head\.weight\)"):
        models.build(hf(tmp_path), SEQ)


def test_an_encoder_with_another_tasks_head_exits_2_saying_it_has_no_causal_lm_head(
    tmp_path: Path, exporter_cli: Callable[..., CliResult]
) -> None:
    # An encoder model=hf takes with its masked-LM head or headless (tests/test_hf_encoder.py),
    # and not with a classifier's.
    bert = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=256,
    )
    transformers.BertForSequenceClassification(bert).save_pretrained(tmp_path / "bert")
    result = exporter_cli("model=hf", f"model.checkpoint={tmp_path / 'bert'}", "mlflow=off")
    assert_user_error(
        result,
        2,
        "model_type 'bert' (saved as BertForSequenceClassification) has no causal-LM head",
    )


def test_a_checkpoint_that_needs_remote_code_exits_2_saying_it_is_refused(
    tmp_path: Path, exporter_cli: Callable[..., CliResult]
) -> None:
    config = {
        "model_type": "my_llm",
        "architectures": ["MyLlmForCausalLM"],
        "auto_map": {"AutoModelForCausalLM": "modeling_my_llm.MyLlmForCausalLM"},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "modeling_my_llm.py").write_text("raise SystemExit('remote code ran')\n")
    result = exporter_cli("model=hf", f"model.checkpoint={tmp_path}", "mlflow=off")
    assert_user_error(result, 2, "model_type 'my_llm'", "(auto_map)", "refuses remote code")
    assert "remote code ran" not in result.output


def test_a_missing_checkpoint_directory_exits_2_at_compose(
    exporter_cli: Callable[..., CliResult],
) -> None:
    result = exporter_cli("model=hf", "model.checkpoint=/no/such/dir")
    assert_user_error(result, 2, "model.checkpoint=/no/such/dir: no such directory")


def test_model_hf_without_a_checkpoint_exits_2_saying_what_to_set(
    exporter_cli: Callable[..., CliResult],
) -> None:
    result = exporter_cli("model=hf")
    assert_user_error(result, 2, "model.checkpoint is not set", "model.checkpoint=DIR")
    assert "Missing mandatory value" not in result.output
    assert not (result.run_dir / "traceback.txt").exists()


# Runs the command and says, as it exits, whether its process imported torch.
WATCHING_IMPORTS = """
import atexit, sys
atexit.register(lambda: print("torch imported:", "torch" in sys.modules))
sys.argv = ["exporter", *sys.argv[1:]]
from exporter.command import cli
cli.main()
"""


@pytest.mark.parametrize(
    ("config_json", "message"),
    [
        (None, "not a Hugging Face checkpoint (no config.json and no .gguf file)"),
        ('{"model_type": "llama",', "config.json is not JSON"),
        ('{"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}', "has no causal"),
        ('{"model_type": "my_llm"}', "model_type 'my_llm' is not one transformers"),
    ],
)
def test_a_checkpoints_config_json_is_refused_before_torch_loads(
    tmp_path: Path, config_json: str | None, message: str
) -> None:
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    if config_json is not None:
        (checkpoint / "config.json").write_text(config_json)
    output = refused_before_torch_loads(tmp_path, "model=hf", f"model.checkpoint={checkpoint}")
    assert f"model.checkpoint={checkpoint}: " in output
    assert message in output


def refused_before_torch_loads(tmp_path: Path, *overrides: str) -> str:
    """The output of a job that exits 2 at compose: neither the command's process nor a job's
    worker (which needs a run dir) loaded torch, and no MLflow store was made."""
    overrides = (*overrides, f"hydra.run.dir={tmp_path}/run")
    command = [sys.executable, "-c", WATCHING_IMPORTS, *command_line(tmp_path, *overrides)[3:]]
    completed = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 2, output
    assert "Traceback" not in output
    assert "torch imported: False" in output
    assert not (tmp_path / "run").exists()
    assert not (tmp_path / "mlflow.db").exists()
    return output


# The architecture whose static-cache job runs by default: GPT-2, with its learned positions and
# fused qkv; the rotary decoders build their caches as model=llama does (tests/test_kv_cache.py),
# and Gemma2's sliding window has its own test below.
DEFAULT_KV_CACHE_JOBS = {"gpt2"}


@pytest.mark.parametrize(
    ("name", "backend"),
    [
        *(
            pytest.param(
                name, "eager", marks=[] if name in DEFAULT_KV_CACHE_JOBS else [pytest.mark.slow]
            )
            for name in sorted(ARCHITECTURES)
        ),
        pytest.param("gpt2", "executorch", marks=pytest.mark.slow),
    ],
)
def test_each_architecture_passes_every_session_with_a_static_kv_cache(
    name: str, backend: str, checkpoints, tmp_path: Path
) -> None:
    assert_kv_sessions_pass(tmp_path, checkpoints(name), backend)


def test_a_sliding_window_shorter_than_the_cache_passes_every_session(tmp_path: Path) -> None:
    # Gemma2's window layers keep 8 slots of a 16-slot cache: every decode step past position 8
    # reads a window that has rolled over, as the oracle's sliding mask sees it. Two layers: a
    # window layer and a global one, whose caches differ.
    gemma2 = ARCHITECTURES["gemma2"]
    torch.manual_seed(0)
    fields = {**gemma2.fields, "num_hidden_layers": 2, "sliding_window": 8}
    model = gemma2.model(gemma2.config(**fields))
    model.save_pretrained(tmp_path / "gemma2")
    assert_kv_sessions_pass(tmp_path / "run", tmp_path / "gemma2", "eager")


def assert_kv_sessions_pass(run_dir: Path, checkpoint: Path, backend: str) -> None:
    record, report = job_in_process(
        run_dir,
        "model=hf",
        f"model.checkpoint={checkpoint}",
        f"backend={backend}",
        "model.kv_cache=static",
        "dynamic.seq.max=16",
    )
    assert record.error is None
    steps = [e["shape"] for e in report["executions"]]
    assert {s["session"] for s in steps if s["pos"] == 15} == {0, 1}
    assert all(e["passed"] for e in report["executions"])
    assert report["greedy"]["artifact_parts_from_oracle_at"] is None


def test_a_model_without_attention_caches_is_refused_with_a_static_cache(tmp_path: Path) -> None:
    torch.manual_seed(0)
    mamba = transformers.MambaConfig(
        hidden_size=32, num_hidden_layers=2, vocab_size=256, state_size=4
    )
    transformers.MambaForCausalLM(mamba).save_pretrained(tmp_path)
    refused = r"cannot build a static KV cache for MambaForCausalLM \(mamba\): AttributeError"
    with pytest.raises(ConfigError, match=refused):
        models.build(hf(tmp_path, kv_cache=KvCache.static), {"seq": DimBounds(min=1, max=16)})
    # Without a cache it builds as before.
    assert models.build(hf(tmp_path), SEQ).decoder is None
