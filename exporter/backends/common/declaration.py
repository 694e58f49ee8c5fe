"""What a backend is: `Backend`, the one declaration each backend module makes (`BACKEND`), with
the defaults most backends share.

Its data: the config schema (whose `name` default is the backend's name, and whose `devices`
are where its artifact runs), the runtime of runtimes/loaders/ that loads its artifact, its
delegate's id in partition reports, the weights audit's reader of its artifact, what it is
known to lose at half dtypes, and the dtype it keeps quantized weights' per-group scales in.
Its behaviour: the methods below, which a backend overrides where it differs from the defaults
(`output` and `lower` it always writes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exporter.config import BackendConfig, FallbackConfig, LlmOps

if TYPE_CHECKING:
    from exporter.artifact import Artifact, Output, WeightsReader
    from exporter.export import Exported


@dataclass(frozen=True)
class Backend:
    # The backend's config: `name` defaults to the module's name; its other defaults, its own
    # settings and its `devices` are the backend's.
    schema: type[BackendConfig]
    # The loader of runtimes/loaders/ that runs the artifact.
    runtime: str
    # Its backend id in partition reports; None where nothing is delegated.
    delegate: str | None
    # Which reader of the weights audit reads its artifact's weights (exporter/audit/readers.py).
    audit: WeightsReader
    # By model dtype, a measured statement of where its artifacts lose precision that eager at
    # that dtype does not, which a failed validation at that dtype quotes.
    half_precision: Mapping[str, str] = field(default_factory=dict)
    # The dtype (a torch dtype's name) its kernels read per-group weight scales in where that
    # is not the model's: the quantize stage rounds them so, and the quantized model is then
    # what the artifact computes. None: the model's own.
    group_scales: str | None = None

    @property
    def name(self) -> str:
        return next(f.default for f in dataclasses.fields(self.schema) if f.name == "name")

    def output(self, config: Any) -> Output:
        """The file a config of it makes (with `runtime=None` for a report with nothing to run)."""
        raise NotImplementedError(f"backend {self.name} declares no output()")

    def check(self, config: Any, fallback: FallbackConfig) -> None:
        """Raises ConfigError where config and fallback contradict, or this machine lacks what
        the backend needs. By default there is nothing to check."""

    def toolchain(self, config: Any) -> dict[str, str]:
        """What shapes its artifact besides the project's code and Python libraries (a compiler,
        a GPU): part of the lowering's cache key. By default nothing: the libraries its lowering
        imports are in the key already."""
        return {}

    def llm_ops(self, config: Any) -> LlmOps:
        """The ops the model stage builds a static KV cache with for this backend's runtime:
        by default transformers' own, which every runtime runs."""
        return LlmOps.plain

    def lower(
        self, exported: Exported, config: Any, fallback: FallbackConfig, out_dir: Path
    ) -> Artifact:
        """Writes the artifact into `out_dir`, mapping the fallback policy to its own controls."""
        raise NotImplementedError(f"backend {self.name} declares no lower()")

    def reference_device(self, config: Any) -> str:
        """The torch device where eager PyTorch runs at the model's dtype to measure the error
        the reference rule scales: the artifact's own, since the same dtype rounds differently
        on a GPU. By default `backend.device`, a torch device."""
        return config.device

    def eager_device(self, config: Any, target: Mapping[str, str]) -> str:
        """The torch device eager runs on to be timed beside the artifact, which ran on
        `target` (what its runtime says it picked): by default `backend.device`."""
        return config.device
