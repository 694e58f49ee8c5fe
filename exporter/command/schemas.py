"""The schemas conf/ selects, stored in Hydra's ConfigStore before anything composes a config:
the job's, each model's and each backend module's (exporter/backends/).

Storing every backend's schema imports every backend module, so this stands with the command,
above the backends; the schemas themselves (exporter/config/), which every stage imports,
import no backend.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from exporter import backends
from exporter.config import (
    BenchmarkConfig,
    CustomModelConfig,
    EncoderConfig,
    FallbackConfig,
    HfConfig,
    JobConfig,
    LlamaConfig,
    MaskedConfig,
    MlflowConfig,
    MlpConfig,
    MoeConfig,
    QuantizeConfig,
    ToyConfig,
    ValidateConfig,
)


def register_schemas() -> None:
    """Called by the command before Hydra composes, and by anything else that composes (tests,
    benchmarks)."""
    store = ConfigStore.instance()
    store.store(name="job_schema", node=JobConfig)
    store.store(group="schema/model", name="llama", node=LlamaConfig)
    store.store(group="schema/model", name="hf", node=HfConfig)
    store.store(group="schema/model", name="mlp", node=MlpConfig)
    store.store(group="schema/model", name="moe", node=MoeConfig)
    store.store(group="schema/model", name="masked", node=MaskedConfig)
    store.store(group="schema/model", name="encoder", node=EncoderConfig)
    store.store(group="schema/model", name="custom", node=CustomModelConfig)
    store.store(group="schema/model", name="toy", node=ToyConfig)
    for name, schema in backends.schemas().items():
        store.store(group="schema/backend", name=name, node=schema)
    store.store(group="schema/fallback", name="fallback", node=FallbackConfig)
    store.store(group="schema/validate", name="validate", node=ValidateConfig)
    store.store(group="schema/quantize", name="quantize", node=QuantizeConfig)
    store.store(group="schema/benchmark", name="benchmark", node=BenchmarkConfig)
    store.store(group="schema/mlflow", name="mlflow", node=MlflowConfig)
