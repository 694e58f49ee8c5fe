"""Each cached result's key holds the code that computes it: every project source a stage
imports while it runs (lazily, or through importlib, which the key's static reading of imports
does not follow) is among the sources its key hashes. A refactor that moves a stage's code out
of its key's reach fails here, before the cache certifies a result its code no longer makes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from tests.conftest import PROJECT_ROOT
from tests.test_hf_encoder import BERT

ONE_LAYER = ("model=llama", "model.num_hidden_layers=1")


@pytest.mark.parametrize(
    "overrides",
    [
        (*ONE_LAYER, "backend=executorch"),
        (*ONE_LAYER, "model.kv_cache=static", "backend=executorch"),
        (*ONE_LAYER, "quantize=8da4w", "backend=executorch"),
        ("model=mlp", "backend=webgpu"),
        ("model=moe", "backend=eager"),
        pytest.param((*ONE_LAYER, "backend=aoti"), marks=pytest.mark.slow),
    ],
    ids=["executorch", "kv_cache", "8da4w", "webgpu", "moe", "aoti"],
)
def test_every_source_a_cached_stage_imports_is_in_its_key(overrides: tuple[str, ...]) -> None:
    assert_keys_hold_their_sources(*overrides)


def test_an_encoder_checkpoints_model_key_holds_its_builder(tmp_path: Path) -> None:
    # model=hf dispatches to exporter/models/hf_encoder.py for a BERT: its key must hold it.
    transformers.BertForMaskedLM(transformers.BertConfig(**BERT)).save_pretrained(tmp_path)
    assert_keys_hold_their_sources(
        "model=hf",
        "dynamic=hf_encoder",
        "dynamic.seq.max=64",
        f"model.checkpoint={tmp_path}",
        "backend=eager",
    )


def assert_keys_hold_their_sources(*overrides: str) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "tests.key_coverage", *overrides],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    missing = json.loads(completed.stdout.strip().splitlines()[-1])
    assert all(files == [] for files in missing.values()), missing
    assert set(missing) >= {"model", "export", "lower", "goldens"}
