"""A .pte that calls ExecuTorch's LLM ops (llama::update_cache, as optimum-executorch's and
ExecuTorch's own LLM exports write) loads with the executorch loader alone: it registers their
kernels for such a program, in a process that never imported them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from executorch.exir import to_edge_transform_and_lower
from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401

from runtimes.loaders.executorch import operators

PROJECT_ROOT = Path(__file__).resolve().parents[1]


class CacheWrite(torch.nn.Module):
    """Writes a value into an 8-slot cache buffer at a position with llama::update_cache."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 8, 2, 4))

    def forward(self, value: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        torch.ops.llama.update_cache(value, self.cache, start.item())
        return self.cache + 0


def test_a_program_with_llm_ops_loads_and_runs_in_a_fresh_process(tmp_path: Path) -> None:
    program = torch.export.export(
        CacheWrite(), (torch.ones(1, 1, 2, 4), torch.tensor(3)), strict=True
    )
    path = tmp_path / "model.pte"
    path.write_bytes(to_edge_transform_and_lower(program).to_executorch().buffer)
    assert "llama::update_cache.out" in operators(path)
    run = (
        "import sys, torch; from pathlib import Path; from runtimes import load; "
        "(cache,) = load(Path(sys.argv[1]), 'executorch').run("
        "[torch.ones(1, 1, 2, 4), torch.tensor(3)]); "
        "print(cache[0, :, 0, 0].tolist())"
    )
    done = subprocess.run(
        [sys.executable, "-c", run, str(path)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]"
