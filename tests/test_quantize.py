"""Quantized models judged for fidelity: the artifact against the quantized model (a float64
oracle of its own arithmetic, the reference rule scaled by eager's error at the model's dtype).
Each scheme passes where its backend computes it right, a backend refuses at compose what it
cannot compute right, and two planted faults fail: XNNPACK's garbage for torchao's weight-only
layers (the refusal bypassed) and a lowering that rounds activations otherwise."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
from torchao.quantization.granularity import PerGroup
from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
    IntxUnpackedToInt8Tensor,
)
from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
    _apply_int8_act_asym_per_token_quant_dequant as torchao_activation_rounding,
)

from exporter import backends, config, models, quantize
from exporter.artifact.partition import DELEGATED
from exporter.backends.eager import Eager
from exporter.errors import ConfigError, QualityFailed, ValidationFailed
from exporter.job import stages
from exporter.tracking.record import JobRecord
from exporter.validate import quantized_layers
from exporter.validate.oracle import float64_weights
from tests.conftest import composed, job_in_process, run_command

TINY = ("model.num_hidden_layers=1", "dynamic.seq.max=16")
# A one-layer Llama's linear layers: q, k, v, o, gate, up, down and the output projection.
LINEAR_LAYERS = 8


def quantized_linear(**settings: object) -> torch.nn.Linear:
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96)
    config_ = Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4, weight_granularity=PerGroup(32), **settings
    )
    quantize_(layer, config_)
    return layer


def test_the_oracles_activation_rounding_is_torchaos_per_token_asymmetric_rounding() -> None:
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(0))
    eps = torch.finfo(torch.float32).smallest_normal
    ours = quantized_layers.int8_per_token(x.double(), eps)
    # torchao's at float32: the same rounding, so no step apart anywhere (a step is ~1e-2).
    assert (ours - torchao_activation_rounding(x).double()).abs().max() < 1e-6
    # A token from 0 to 255: scale 1, zero point -128, and 3.5 a tie, which torch.round takes to
    # 4 (half to even); with ties flipped it goes to 3, and nothing else moves.
    token = torch.tensor([[0.0, 255.0, 3.5, 7.25, 100.4]], dtype=torch.float64)
    rounded = quantized_layers.int8_per_token(token, eps)
    flipped = quantized_layers.int8_per_token(token, eps, ties_flipped=True)
    assert rounded.tolist() == [[0.0, 255.0, 4.0, 7.0, 100.0]]
    assert flipped.tolist() == [[0.0, 255.0, 3.0, 7.0, 100.0]]


def test_a_quantized_layers_oracle_is_eager_but_for_near_ties_and_leaves_it_as_it_was() -> None:
    layer = quantized_linear()
    scale = layer.weight.scale.clone()
    x = torch.randn(4, 5, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = layer(x).double()
        with float64_weights(layer):
            oracle = layer(x)
        with float64_weights(layer, ties_flipped=True):
            band = (layer(x) - oracle).abs().amax(dim=-1)
    assert oracle.dtype == torch.float64
    # Token by token: eager's float32 arithmetic, or a near tie rounded the other way.
    apart = (eager - oracle).abs().amax(dim=-1)
    assert bool((apart < 1e-5).float().mean() > 0.9)
    assert bool(((apart < 1e-5) | (apart <= band + 1e-5)).all())
    assert "forward" not in vars(layer)
    assert torch.equal(layer.weight.scale, scale)


def test_the_quantized_copy_holds_the_float_models_unquantized_weights_once() -> None:
    job = config.to_job(composed(*TINY, "model.kv_cache=static", "backend=eager", "quantize=8da4w"))
    float_bundle = models.build(job.model, job.dynamic)
    before = {n: p.detach().clone() for n, p in float_bundle.module.named_parameters()}
    bundle = quantize.quantized(float_bundle, job.quantize)
    float_params = dict(float_bundle.module.named_parameters())
    params = dict(bundle.module.named_parameters())
    linear = [n for n, p in params.items() if isinstance(p, IntxUnpackedToInt8Tensor)]
    # What stays float (the token embedding, the norms) is the same tensor in both models.
    assert len(linear) == LINEAR_LAYERS
    kept = [n for n in params if n not in linear]
    assert kept and all(params[n] is float_params[n] for n in kept)
    # The float model is as it was, its layers float; the uncached model shares the quantized
    # layers; the KV cache is the copy's own.
    assert all(torch.equal(float_params[n], before[n]) for n in before)
    assert not any(isinstance(p, IntxUnpackedToInt8Tensor) for p in float_params.values())
    uncached = dict(bundle.decoder.uncached.named_parameters())
    assert sum(isinstance(p, IntxUnpackedToInt8Tensor) for p in uncached.values()) == len(linear)
    buffers, float_buffers = (
        dict(bundle.module.named_buffers()),
        dict(float_bundle.module.named_buffers()),
    )
    assert buffers and all(buffers[n] is not float_buffers[n] for n in buffers)


@pytest.mark.parametrize(
    "overrides",
    [
        ("quantize=8da4w",),
        ("quantize=8da8w",),
        ("quantize=int8_weight", "quantize.embedding=int8"),
        ("quantize=int4_weight", "quantize.embedding=int4"),
    ],
)
def test_each_scheme_on_eager_passes_fidelity(tmp_path: Path, overrides: tuple[str, ...]) -> None:
    record, report = job_in_process(tmp_path, "backend=eager", *TINY, *overrides)
    assert record.error is None
    assert report["passed"]
    quantization = report["quantization"]
    assert quantization["linear_layers"] == LINEAR_LAYERS
    assert quantization["embedding_layers"] == (0 if len(overrides) == 1 else 1)
    assert quantization["scales_rounded_to"] is None
    # The exported program is the quantized model: eager's error, not a step of rounding.
    worst = max(o["max_abs"] for e in report["executions"] for o in e["outputs"])
    assert worst < 1e-5


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (
            ("backend=executorch", "quantize=int8_weight"),
            "quantize=int8_weight: backend=executorch runs quantize=none, 8da4w, 8da8w, auto only",
        ),
        (
            ("backend=executorch", "quantize=8da4w", "quantize.embedding=int4"),
            "quantize.embedding=int4: backend=executorch runs quantize.embedding=none only",
        ),
        (("backend=webgpu", "quantize=8da8w"), "backend=webgpu runs quantize=none only"),
        (
            ("backend=tensorrt", "quantize=int4_weight"),
            "quantize=int4_weight: backend=tensorrt runs quantize=none only",
        ),
    ],
)
def test_a_backend_refuses_at_compose_what_it_does_not_compute_right(
    overrides: tuple[str, ...], named: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        config.to_job(composed(*overrides))
    assert named in str(refused.value)


def test_the_weight_only_refusal_exits_2_without_a_traceback(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    completed = run_command(
        tmp_path, f"hydra.run.dir={runs}/run", "backend=executorch", "quantize=int4_weight"
    )
    assert completed.returncode == 2, completed.stdout + completed.stderr
    assert "quantize=int4_weight: backend=executorch runs" in completed.stderr
    assert "computes garbage" in completed.stderr
    assert "Traceback" not in completed.stderr
    assert not runs.exists()


def job_with(
    run_dir: Path, backend: backends.ConfiguredBackend, *overrides: str
) -> tuple[ValidationFailed | None, dict]:
    """A job of `overrides`, its stages handed `backend` (which its config may refuse at
    compose): the validation error it ended with (None where it passed), and report.json, whose
    "passed" says fidelity's verdict."""
    job = config.to_job(
        composed("backend=eager", *overrides, "mlflow=off", "benchmark=off", "cache=false")
    )
    # Set, not replaced: replacing would run the job's checks again, and refuse it.
    job.backend = backend.config
    record = JobRecord(run_dir=run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        stages.run(job, backend, record, lambda *_: None)
    except ValidationFailed as error:
        return error, json.loads((run_dir / stages.REPORT_FILE).read_text())
    return None, json.loads((run_dir / stages.REPORT_FILE).read_text())


def assert_failed_on_fidelity(error: ValidationFailed | None, report: dict) -> None:
    """The job failed on fidelity: its artifact computes other than the quantized model. Not
    on quality alone: QualityFailed, the error of a scheme over quantize.budget, is a
    ValidationFailed too (exit 1), and says that fidelity passed."""
    assert error is not None, "the job passed"
    assert not isinstance(error, QualityFailed), f"failed on quality alone: {error}"
    assert type(error) is ValidationFailed and error.exit_code == 1, repr(error)
    # Validation's message and report.json's verdict: the artifact against the quantized model.
    assert "less accurate than eager at the model's dtype" in str(error), error
    assert not report["passed"]


def xnnpack(group_scales: str | None = "bfloat16") -> backends.ConfiguredBackend:
    """The executorch backend of a float job, reading group scales as `group_scales` says."""
    backend = backends.configured(config.to_job(composed("backend=executorch", *TINY)))
    declaration = dataclasses.replace(backend.declaration, group_scales=group_scales)
    return dataclasses.replace(backend, declaration=declaration)


def ops(run_dir: Path, delegated: bool) -> dict[str, int]:
    """Op -> its nodes inside the delegate (or outside it), from partition.json."""
    partition = json.loads((run_dir / "partition.json").read_text())
    counts: dict[str, int] = {}
    for group in partition["groups"]:
        if (group["reason"] == DELEGATED) == delegated:
            counts[group["op"]] = counts.get(group["op"], 0) + group["nodes"]
    return counts


@pytest.fixture(scope="module")
def on_xnnpack(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    """Per scheme: the run dir and report.json of its job on executorch (each made once)."""
    jobs = {}
    for scheme in ("8da4w", "8da8w"):
        run_dir = tmp_path_factory.mktemp(scheme)
        record, report = job_in_process(run_dir, "backend=executorch", f"quantize={scheme}", *TINY)
        assert record.error is None, record.error
        jobs[scheme] = (run_dir, report)
    return jobs


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["8da4w", "8da8w"])
def test_dynamic_activation_schemes_on_xnnpack_pass_fidelity_every_linear_delegated(
    on_xnnpack: dict[str, tuple[Path, dict]], scheme: str
) -> None:
    run_dir, report = on_xnnpack[scheme]
    assert report["passed"]
    inside, outside = ops(run_dir, delegated=True), ops(run_dir, delegated=False)
    # Each quantized linear dequantizes its weight and its rounded activations, all in XNNPACK.
    assert inside["torchao.dequantize_affine.default"] == 2 * LINEAR_LAYERS
    assert inside["torchao.choose_qparams_affine.default"] == LINEAR_LAYERS
    assert not [op for op in outside if "linear" in op or op.startswith("torchao.")]
    scales = "bfloat16" if scheme == "8da4w" else None
    assert report["quantization"]["scales_rounded_to"] == scales


@pytest.mark.slow
def test_fidelity_sees_xnnpacks_bfloat16_scales_against_torchaos_float32_ones(
    on_xnnpack: dict[str, tuple[Path, dict]], tmp_path: Path
) -> None:
    pte = on_xnnpack["8da4w"][0] / "model.pte"
    torchaos = xnnpack(group_scales=None)
    # Localizing the failure is not what this proves (and took 5 of its 6 minutes).
    error, report = job_with(
        tmp_path, torchaos, "quantize=8da4w", f"artifact={pte}", "validate.localize=off", *TINY
    )
    assert_failed_on_fidelity(error, report)
    # A systematic error (the issue measured 8.6e-3 on a 2-layer model), not one flip: it fails
    # at most shapes (where the rounding band holds a flip, it may hide below it).
    failed = [e for e in report["executions"] if not e["passed"]]
    assert len(failed) > len(report["executions"]) / 2


@pytest.mark.slow
@pytest.mark.skip(
    reason="on the one-layer Llama, int8_weight's lowering to XNNPACK fails (exit 4: no out "
    "variant of torchao::dequantize_affine outside the delegate) before fidelity can judge it; "
    "the garbage was measured on one nn.Linear only; needs a model that lowers"
)
def test_xnnpacks_weight_only_garbage_fails_fidelity_when_the_refusal_is_bypassed(
    tmp_path: Path,
) -> None:
    error, report = job_with(tmp_path, xnnpack(), "quantize=int8_weight", *TINY)
    assert_failed_on_fidelity(error, report)
    assert all(not e["passed"] for e in report["executions"])
    # Off by orders of magnitude more than eager (the issue measured 1.7e3 on logits).
    assert min(o["ratio"] for e in report["executions"] for o in e["outputs"]) > 1e3


def symmetric_activations(program: torch.export.ExportedProgram) -> None:
    """A lowering's fault: each layer's activations rounded symmetrically (zero point 0, the
    scale from the larger magnitude), not asymmetrically as torchao's 8da schemes do."""
    for node in program.graph.nodes:
        if node.target is torch.ops.torchao.choose_qparams_affine.default:
            node.args = (node.args[0], "SYMMETRIC", *node.args[2:])
    program.graph_module.recompile()


def test_a_lowering_that_rounds_activations_otherwise_fails_fidelity_and_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lower = Eager.lower

    def planted(self: Eager, exported, config_, fallback, out_dir: Path):
        symmetric_activations(exported.program)
        # The program is saved again from the rewritten graph, not linked from the export's.
        path = out_dir / exported.path.name
        return lower(self, dataclasses.replace(exported, path=path), config_, fallback, out_dir)

    monkeypatch.setattr(Eager, "lower", planted)
    record, report = job_in_process(tmp_path, "backend=eager", "quantize=8da4w", *TINY)
    assert_failed_on_fidelity(record.error, report)
    divergence = report["first_divergence"]
    assert divergence["reproduced"], divergence
    # The first node whose value leaves eager's error: the first layer's activation rounding.
    rounding = ("choose_qparams_affine", "quantize_affine", "dequantize_affine", "getitem")
    assert divergence["node"].startswith(rounding), divergence
