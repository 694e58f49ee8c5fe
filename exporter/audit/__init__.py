"""The weights audit: every constant an artifact carries that came from a model parameter,
checked against that parameter (exactly, or through a stated cast or permutation).

Each backend's declaration names the reader of exporter/audit/readers.py that reads its
artifact's weights (a `WeightsReader`, carried by the artifact as `Artifact.audit`):

- `pte` (executorch, webgpu): the program's constants, its named data and a .ptd beside it
  (exporter/audit/executorch_files.py), and Vulkan payloads' own constants; XNNPACK's and
  Vulkan's constants are keyed by the SHA-256 of their bytes.
- `aoti_package` (.pt2 package): the pickled weights by name (exporter/audit/aoti_package.py).
- `exported_program` (torch.export .pt2): the program's state dict and constants by name.
- `tensorrt_engine`: nothing; every parameter is reported unseen with why (`TENSORRT_UNSEEN`).

A quantized weight (torchao's tensor) is checked as its values, scales and zero points, in the
forms each format stores them, and a mismatch is named by weight and group
(exporter/audit/quantized.py).
A parameter the audit cannot find is unseen, with why, and does not fail the audit; a
parameter whose constant differs does (exporter/audit/matching.py says how they are tied).
Buffers the program writes as it runs (a KV cache's keys, values and fill counters) are state,
not weights: the audit skips them and says so.
Constants are compared on the host, wherever the artifact or the model ran.
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Collection, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from exporter.audit.readers import READERS, nothing_read
from exporter.audit.result import Checked, Corrupted, Mismatch, Unseen, WeightsAudit

if TYPE_CHECKING:
    import torch

    from exporter.artifact import Artifact

__all__ = ["Checked", "Corrupted", "Mismatch", "Unseen", "WeightsAudit", "audit"]


def audit(
    artifact: Artifact, weights: Mapping[str, torch.Tensor], state: Collection[str] = ()
) -> WeightsAudit:
    """Checks the constants of `artifact` against `weights`, the model's parameters and buffers
    by fully qualified name, but for `state`: the buffers the program writes as it runs, whose
    values in the artifact are where a session starts, not the model's."""
    import torch

    skipped = tuple(name for name in weights if name in state)
    weights = {name: w for name, w in weights.items() if name not in state}
    # The host's copies: a program exported on the GPU holds its weights there.
    tensors = {name: w.detach().cpu() for name, w in weights.items() if isinstance(w, torch.Tensor)}
    runtime = str(artifact.runtime)
    read = READERS[artifact.audit]
    try:
        result = read(artifact, tensors)
    except (OSError, ValueError, IndexError, KeyError, struct.error, zipfile.BadZipFile) as error:
        # The runtime, loading the same file, fails the job with its own error; the audit
        # says what it could not read.
        result = nothing_read(runtime, tensors, f"the artifact could not be read: {error}")
    # A program's constants may hold script objects (TorchBind): no bytes to compare.
    objects = tuple(
        Unseen(name, f"a {type(w).__name__}, not a tensor: nothing to compare")
        for name, w in weights.items()
        if name not in tensors
    )
    return replace(result, unseen=result.unseen + objects, state=skipped)
