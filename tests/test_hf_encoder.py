"""model=hf with an encoder-only text checkpoint: a tiny BERT saved with its masked-LM head and
headless, through the builder and through the whole job on eager, ExecuTorch and AOTInductor;
and what only a causal LM takes, refused at compose."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

import runtimes
from exporter import models
from exporter.config import DimBounds, KvCache
from exporter.errors import ConfigError
from exporter.models import DynamicDim
from exporter.models.hf_encoder import EncoderOutput
from exporter.validate.plan import plan
from tests.conftest import job_in_process
from tests.test_hf_models import hf, refused_before_torch_loads

BERT = dict(
    vocab_size=100,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
)
# Each saved class, with the output the job exports and its last axis.
CLASSES = {
    "masked_lm": (transformers.BertForMaskedLM, "logits", BERT["vocab_size"]),
    "encoder": (transformers.BertModel, "last_hidden_state", BERT["hidden_size"]),
}
# dynamic=hf_encoder's bounds, seq within the checkpoint's 64 positions.
BOUNDS = {"batch": DimBounds(1, 8), "seq": DimBounds(1, 64)}
JOB = ("model=hf", "dynamic=hf_encoder", "dynamic.seq.max=64")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny BERT of each class, saved with seeded random weights (safetensors)."""
    root = tmp_path_factory.mktemp("bert")
    saved = {}
    for task, (cls, _, _) in CLASSES.items():
        torch.manual_seed(0)
        cls(transformers.BertConfig(**BERT)).save_pretrained(root / task)
        saved[task] = root / task
    return saved


@pytest.mark.parametrize("task", sorted(CLASSES))
def test_builder_outputs_are_the_checkpoints_own_with_a_padding_mask(
    task: str, checkpoints: dict[str, Path]
) -> None:
    cls, output, width = CLASSES[task]
    bundle = models.build(hf(checkpoints[task]), BOUNDS)
    assert type(bundle.module.model) is cls
    assert bundle.module.model.config._attn_implementation == "sdpa"
    assert bundle.input_names == ("input_ids", "attention_mask")
    assert bundle.output_names == (output,)
    assert bundle.logits_outputs == (("logits",) if task == "masked_lm" else ())
    ids, mask = bundle.make_inputs({"batch": 6, "seq": 40}, 0)
    assert ids.shape == mask.shape == (6, 40)
    assert ids.dtype == mask.dtype == torch.int64
    # The first row fills seq; the others are padded, as a tokenizer pads a batch.
    lengths = mask.sum(dim=1).tolist()
    assert lengths[0] == 40 and min(lengths) < 40 and min(lengths) >= 1
    at_float64 = cls.from_pretrained(checkpoints[task], dtype=torch.float64)
    with torch.no_grad():
        built = bundle.module.to(torch.float64)(ids, mask)
        assert built.shape == (6, 40, width)
        expected = getattr(at_float64(input_ids=ids, attention_mask=mask), output)
        torch.testing.assert_close(built, expected, atol=1e-12, rtol=0)
        # What the mask means: a padded row's tokens come out as the row alone computes them.
        row = lengths.index(min(lengths))
        alone = bundle.module(
            ids[row : row + 1, : lengths[row]], mask[row : row + 1, : lengths[row]]
        )
        torch.testing.assert_close(built[row, : lengths[row]], alone[0], atol=1e-12, rtol=0)


def test_seq_is_bounded_by_the_checkpoints_max_positions(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match=r"beyond what model 'hf' supports \(64\)"):
        models.build(hf(checkpoints["masked_lm"]), {**BOUNDS, "seq": DimBounds(1, 65)})


def test_the_model_stage_refuses_a_kv_cache_for_an_encoder(checkpoints: dict[str, Path]) -> None:
    # A schema built without the composed checks (exporter/config/inputs.py).
    refused = r"model\.kv_cache=static: .* encoder-only text model \(model_type 'bert'"
    with pytest.raises(ConfigError, match=refused):
        models.build(hf(checkpoints["encoder"], kv_cache=KvCache.static), BOUNDS)


@pytest.mark.parametrize(
    ("task", "backend"),
    [
        ("masked_lm", "eager"),
        ("encoder", "eager"),
        ("masked_lm", "executorch"),
        ("encoder", "executorch"),
        ("masked_lm", "aoti"),
        pytest.param("masked_lm", "webgpu", marks=pytest.mark.slow),
    ],
)
def test_job_passes_at_every_batch_and_seq_corner(
    task: str, backend: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    record, report = job_in_process(
        run_dir, *JOB, f"model.checkpoint={checkpoints[task]}", f"backend={backend}"
    )
    assert record.exit_code == 0, record.error
    assert report["passed"]
    assert all(shape["passed"] for shape in report["shapes"])
    dims = [DynamicDim("batch", (), 1, 8), DynamicDim("seq", (), 1, 64)]
    planned = [shape["shape"] for shape in report["shapes"]]
    assert planned == [dict(shape) for shape in plan(dims, [], 2, seed=0)]
    # Every corner of the two dims, the mixed ones too.
    assert {(s["batch"], s["seq"]) for s in planned} >= {(1, 1), (1, 64), (8, 1), (8, 64)}
    _, output, width = CLASSES[task]
    assert report["outputs"] == [output]
    # The artifact itself, on the goldens' largest case: its output's shape, and a padded row
    # as the oracle computes it.
    manifest = json.loads((run_dir / "bundle" / "manifest.json").read_text())
    goldens = torch.load(run_dir / "bundle" / "goldens.pt", weights_only=False)
    (ids, mask), (expected,) = goldens["cases"]["batch=8,seq=64"]
    loaded = runtimes.load(run_dir / manifest["artifact"], manifest["runtime"], manifest["device"])
    (got,) = loaded.run([ids, mask])
    assert got.shape == (8, 64, width)
    assert int(mask.sum()) < mask.numel()
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)


class MaskIgnored(torch.nn.Module):
    """The planted fault: an artifact that attends to every token, its padding too."""

    def __init__(self, encoder: EncoderOutput) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_ids, torch.ones_like(attention_mask))


def test_an_artifact_that_ignores_the_mask_fails_where_a_row_is_padded(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    bundle = models.build(hf(checkpoints["masked_lm"]), BOUNDS)
    batch, seq = (torch.export.Dim(d.name, min=d.min, max=d.max) for d in bundle.dims)
    faulty = torch.export.export(
        MaskIgnored(bundle.module),
        bundle.make_inputs({"batch": 3, "seq": 16}, 0),
        dynamic_shapes={name: {0: batch, 1: seq} for name in bundle.input_names},
    )
    torch.export.save(faulty, tmp_path / "mask_ignored.pt2")
    run_dir = tmp_path / "run"
    record, report = job_in_process(
        run_dir,
        *JOB,
        f"model.checkpoint={checkpoints['masked_lm']}",
        "backend=eager",
        f"artifact={tmp_path / 'mask_ignored.pt2'}",
    )
    assert record.exit_code == 1
    goldens = torch.load(run_dir / "bundle" / "goldens.pt", weights_only=False)
    padded = {}
    for case, ((_, mask), _) in goldens["cases"].items():
        padded[case] = bool((mask == 0).any())
    verdicts = {
        ",".join(f"{k}={v}" for k, v in s["shape"].items()): s["passed"] for s in report["shapes"]
    }
    # Right exactly where no row is padded (one row, or rows all drawn as long as seq).
    assert verdicts == {case: not is_padded for case, is_padded in padded.items()}
    assert sum(padded.values()) >= 5 and sum(not p for p in padded.values()) >= 2


def test_an_encoder_decoder_exits_2_naming_its_model_type_before_torch_loads(
    tmp_path: Path,
) -> None:
    t5 = transformers.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2
    )
    transformers.T5ForConditionalGeneration(t5).save_pretrained(tmp_path / "t5")
    output = refused_before_torch_loads(tmp_path, "model=hf", f"model.checkpoint={tmp_path / 't5'}")
    (line,) = [line for line in output.splitlines() if "model.checkpoint=" in line]
    assert "model_type 't5' (saved as T5ForConditionalGeneration) has no causal-LM head" in line
    assert "encoder-only text models" in line


@pytest.mark.parametrize(
    ("overrides", "setting"),
    [
        (("model.kv_cache=static",), "model.kv_cache=static"),
        (("model.kv_cache=static", "validate.prompt=Hello"), "validate.prompt"),
        (("quantize=auto",), "quantize=auto"),
    ],
)
def test_what_only_a_causal_lm_takes_exits_2_in_one_line(
    overrides: tuple[str, ...], setting: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    checkpoint = checkpoints["masked_lm"]
    output = refused_before_torch_loads(
        tmp_path, *JOB, f"model.checkpoint={checkpoint}", "mlflow=off", *overrides
    )
    (line,) = [line for line in output.splitlines() if "encoder-only" in line]
    assert f"{setting}: model.checkpoint={checkpoint} is an encoder-only text model" in line
    assert "model_type 'bert'" in line and f"{setting} is a causal LM's alone" in line


def test_a_causal_lms_dims_are_refused_for_an_encoder(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    output = refused_before_torch_loads(
        tmp_path, "model=hf", f"model.checkpoint={checkpoints['encoder']}", "mlflow=off"
    )
    assert (
        "whose dims are batch and seq (dynamic=hf_encoder), and dynamic bounds seq: choose "
        "dynamic=hf_encoder." in output
    )


def test_an_encoder_checkpoint_in_model_llama_points_to_model_hf(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    checkpoint = checkpoints["masked_lm"]
    output = refused_before_torch_loads(
        tmp_path, "model=llama", f"model.checkpoint={checkpoint}", "mlflow=off"
    )
    assert f"use model=hf dynamic=hf_encoder model.checkpoint={checkpoint}" in output
