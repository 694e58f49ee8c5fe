"""llama.cpp as the yardstick of a GGUF file's artifacts (runtimes/loaders/llama_cpp.py): it runs
a GGUF checkpoint as an artifact with a KV cache is run (a prefill, steps that continue it, a
slot rewritten), computes what the file's model computes, and with quantize.llama_cpp the job
reports its figures on the quality text beside the artifact's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exporter import models
from exporter.config import DimBounds, HfConfig
from runtimes import load
from runtimes.verdict.sessions import Cache
from tests import gguf_checkpoint, trained_llama
from tests.conftest import job_in_process


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = gguf_checkpoint.tiny_llama()
    return gguf_checkpoint.write(model, tmp_path_factory.mktemp("gguf") / "tiny.F32.gguf")


def test_llama_cpp_computes_the_files_model_and_runs_sessions_as_an_artifact(
    written: Path,
) -> None:
    bundle = models.build(HfConfig(name="hf", checkpoint=str(written)), {"seq": DimBounds(1, 32)})
    tokens = torch.arange(3, 35).unsqueeze(0)
    with torch.no_grad():
        expected = bundle.module(tokens)[0].to(torch.float64)
    llama = load(written, "llama_cpp")
    cache = Cache(llama, 32)
    prefill = cache.call(tokens[:, :20], 0)[0][0].to(torch.float64).clone()
    steps = [
        cache.call(tokens[:, p : p + 1], p)[0][0].to(torch.float64).clone() for p in range(20, 32)
    ]
    found = torch.cat([prefill, *steps])
    assert found.shape == expected.shape
    # float32 weights, llama.cpp's float16 KV cache: the same model within its rounding.
    scale = float(expected.abs().max())
    assert float((found - expected).abs().max()) < 0.02 * scale
    assert torch.equal(found.argmax(-1), expected.argmax(-1))
    # A decode step run again at the same slot (as the benchmark does) computes the same logits.
    again = cache.loaded.run((tokens[:, 31:32], torch.tensor([31])))[0][0].to(torch.float64)
    assert torch.equal(again, steps[-1])


def test_quantize_llama_cpp_sets_llama_cpps_figures_beside_the_artifacts(tmp_path: Path) -> None:
    types = {
        f"blk.{layer}.{name}.weight": "Q4_1"
        for layer in (0, 1)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    }
    path = gguf_checkpoint.write(trained_llama.trained(), tmp_path / "trained.Q4_1.gguf", types)
    record, report = job_in_process(
        tmp_path / "run",
        "backend=eager",
        "model=hf",
        f"model.checkpoint={path}",
        "model.kv_cache=static",
        "dynamic.seq.max=64",
        "quantize=auto",
        "quantize.llama_cpp=true",
    )
    assert record.error is None, record.error
    text = report["quality"]["text"]
    ours, theirs = text["artifact"], text["llama_cpp"]
    assert theirs["positions"] == ours["positions"] == 5 * 64
    # llama.cpp rounds activations to 8 bits per block of 32 for its dot products; the artifact
    # computes the file's codes with bfloat16 activations. Both stay close to the float model.
    assert theirs["top1"] > 0.9 and theirs["kld_mean"] < 0.05
    assert ours["kld_mean"] < theirs["kld_mean"]
