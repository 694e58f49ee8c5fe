"""Typed schemas of a job, stored in Hydra's ConfigStore by the command
(exporter/command/schemas.py): a wrong key or type fails at compose.

The YAML files in `conf/` pick a schema from the `schema/<group>` entries and fill in its
values. Each group's schemas are in a module of their own (model.py, backend.py, validate.py,
quantize.py, tracking.py), each checking what types alone cannot (bounds, contradictions) from
its own fields; job.py holds the job's schema and the checks that read two groups; compose.py
turns the composed config into the typed job, and inputs.py checks the files and packages it
names. hf_checkpoint.py, gguf_header.py and aten_ops.py read checkpoints and torch's
declarations without loading torch.
"""

from exporter.config.backend import (
    BackendConfig,
    FallbackConfig,
    FallbackPolicy,
    LlmOps,
    WrongKernels,
)
from exporter.config.compose import PROJECT_ROOT, flatten, mlflow_of, to_job
from exporter.config.job import JobConfig
from exporter.config.model import (
    CausalLmConfig,
    CustomModelConfig,
    DimBounds,
    DimMode,
    EncoderConfig,
    ExportConfig,
    ExportFailurePolicy,
    GuardPolicy,
    HfConfig,
    KvCache,
    LlamaConfig,
    MaskedConfig,
    MlpConfig,
    ModelConfig,
    ModelDtype,
    MoeConfig,
    ToyConfig,
    ToyKind,
)
from exporter.config.quantize import EmbeddingQuant, QualityBudget, QuantizeConfig, QuantScheme
from exporter.config.tracking import MlflowConfig
from exporter.config.validate import (
    DEFAULT_FACTORS,
    BenchmarkConfig,
    HalfRule,
    LocalizeMode,
    RepairMode,
    ValidateConfig,
    ValidationRule,
)

__all__ = [
    "DEFAULT_FACTORS",
    "PROJECT_ROOT",
    "BackendConfig",
    "BenchmarkConfig",
    "CausalLmConfig",
    "CustomModelConfig",
    "DimBounds",
    "DimMode",
    "EmbeddingQuant",
    "EncoderConfig",
    "ExportConfig",
    "ExportFailurePolicy",
    "FallbackConfig",
    "FallbackPolicy",
    "GuardPolicy",
    "HalfRule",
    "HfConfig",
    "JobConfig",
    "KvCache",
    "LlamaConfig",
    "LlmOps",
    "LocalizeMode",
    "MaskedConfig",
    "MlflowConfig",
    "MlpConfig",
    "ModelConfig",
    "ModelDtype",
    "MoeConfig",
    "QualityBudget",
    "QuantScheme",
    "QuantizeConfig",
    "RepairMode",
    "ToyConfig",
    "ToyKind",
    "ValidateConfig",
    "ValidationRule",
    "WrongKernels",
    "flatten",
    "mlflow_of",
    "to_job",
]
