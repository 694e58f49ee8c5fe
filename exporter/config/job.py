"""The job's schema, which holds every group's, with the checks that read two groups (the
model's dtype and the quantization against what the backend computes, the dynamic dims against
what validation and the KV cache take). A check that reads one group's fields is that group's own
(its `__post_init__`); the files and packages a job names are checked after the schema is
built (exporter/config/inputs.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from exporter.config.backend import BackendConfig, FallbackConfig
from exporter.config.model import (
    CausalLmConfig,
    DimBounds,
    ExportConfig,
    GuardPolicy,
    KvCache,
    ModelConfig,
)
from exporter.config.quantize import INT4_KERNEL_GROUPS, QuantizeConfig, QuantScheme
from exporter.config.tracking import MlflowConfig
from exporter.config.validate import DEFAULT_FACTORS, BenchmarkConfig, ValidateConfig
from exporter.errors import ConfigError


@dataclass
class JobConfig:
    model: ModelConfig = MISSING
    dynamic: dict[str, DimBounds] = field(default_factory=dict)
    export: ExportConfig = field(default_factory=ExportConfig)
    backend: BackendConfig = MISSING
    fallback: FallbackConfig = MISSING
    validate: ValidateConfig = MISSING
    quantize: QuantizeConfig = MISSING
    benchmark: BenchmarkConfig = MISSING
    mlflow: MlflowConfig = MISSING
    # A pre-built artifact to validate instead of exporting and lowering the model.
    artifact: str | None = None
    # Reuse exported programs, goldens and lowered artifacts across jobs (`cache=off`: rebuild).
    cache: bool = True
    # Write bundle/ into the run dir: the artifact, its goldens and plan, for a target's check
    # (`python -m runtimes.check`) without the model (`bundle=off`: none).
    bundle: bool = True
    cache_dir: str = "${project_root:}/outputs/cache"

    def __post_init__(self) -> None:
        if self.model.dtype not in self.backend.dtypes:
            allowed = ", ".join(dtype.value for dtype in self.backend.dtypes)
            raise ConfigError(
                f"model.dtype={self.model.dtype.value}: backend={self.backend.name} computes in "
                f"{allowed} only (allowed values of model.dtype with this backend)."
            )
        self._check_quantize()
        self._check_dynamic()
        refusal = self.backend.runtime_guards_refusal
        if self.export.guards is GuardPolicy.runtime and refusal:
            raise ConfigError(
                f"export.guards=runtime: backend={self.backend.name} cannot lower a program "
                f"whose guards are checked at run time ({refusal}); backend=aoti and "
                "backend=eager can, or narrow the dynamic bounds to where export proves the "
                "guards (export.guards=prove)."
            )
        for size in self.validate.extra_shapes:
            for name, bounds in self.dynamic.items():
                if not bounds.min <= size <= bounds.max:
                    raise ConfigError(
                        f"validate.extra_shapes has {size}, outside dynamic.{name} bounds "
                        f"[{bounds.min}, {bounds.max}]; "
                        f"allowed sizes are {bounds.min}..{bounds.max}."
                    )
        for name in ("atol", "rtol"):
            # validate's tolerance where set, else the backend's default: name the one in force.
            owner = "backend" if getattr(self.validate, name) is None else "validate"
            value = getattr(self, name)
            if value < 0:
                raise ConfigError(f"{owner}.{name} is {value}; it must be 0 or more.")
        if (
            self.validate.prompt is not None
            and getattr(self.model, "kv_cache", None) is not KvCache.static
        ):
            raise ConfigError(
                "validate.prompt is the prompt of a KV-cache model's greedy generation; set "
                "model.kv_cache=static (a causal LM with a checkpoint's tokenizer: model=hf or "
                "model=llama with model.checkpoint)."
            )
        # The factor in force, validate's or else the model dtype's default: the job's to check.
        if self.factor < 1:
            raise ConfigError(
                f"validate.factor is {self.factor}; it must be 1 or more (the artifact's error "
                "over eager's at the model's dtype)."
            )
        self._check_cache()

    def _check_quantize(self) -> None:
        """The quantization asked for must be one the backend computes right, and one that
        llama.cpp can run beside the artifact where quantize.llama_cpp asks it to."""
        backend, quantize = self.backend, self.quantize
        for key, choice, allowed in (
            ("quantize", quantize.scheme, backend.quant_schemes),
            ("quantize.embedding", quantize.embedding, backend.embedding_quants),
        ):
            if choice not in allowed:
                names = ", ".join(option.value for option in allowed)
                raise ConfigError(
                    f"{key}={choice.value}: backend={backend.name} runs {key}={names} only "
                    f"(allowed values of {key} with this backend). {backend.quant_refusal}"
                )
        if (
            backend.int4_weight_packed
            and quantize.scheme is QuantScheme("int4_weight")
            and quantize.group_size not in INT4_KERNEL_GROUPS
        ):
            raise ConfigError(
                f"quantize.group_size={quantize.group_size}: backend={backend.name} computes "
                "quantize=int4_weight with PyTorch's int4 kernel, which takes groups of "
                f"{', '.join(map(str, INT4_KERNEL_GROUPS))}."
            )
        checkpoint = getattr(self.model, "checkpoint", None)
        if quantize.llama_cpp and not (quantize.enabled and checkpoint):
            raise ConfigError(
                "quantize.llama_cpp: llama.cpp runs the GGUF checkpoint a quantized model was "
                "read from; set model.checkpoint=FILE.gguf and a quantize scheme."
            )
        if quantize.scheme is QuantScheme("auto") and not backend.quantize_recipes():
            raise ConfigError(
                f"quantize=auto: backend={backend.name} on {backend.device} has no "
                "quantized layers to plan with; use backend=aoti or eager (cpu), or "
                "executorch."
            )

    def _check_dynamic(self) -> None:
        """Checked here rather than by DimBounds: a bound is named by its key in `dynamic`,
        which a DimBounds does not know, and one export takes one mode for all its dims."""
        modes = {bounds.mode for bounds in self.dynamic.values() if bounds.min < bounds.max}
        if len(modes) > 1:
            # torch.export takes one kind of spec for all of an export's dims: ShapesSpec makes
            # every dim it names unbacked, a Dim-style spec makes every dim backed.
            raise ConfigError(
                "dynamic: "
                + ", ".join(f"{name}.mode={b.mode.value}" for name, b in self.dynamic.items())
                + "; one export takes all its dims backed or all unbacked."
            )
        for name, bounds in self.dynamic.items():
            if bounds.min < 1:
                raise ConfigError(f"dynamic.{name}.min is {bounds.min}; it must be at least 1.")
            if bounds.min > bounds.max:
                raise ConfigError(
                    f"dynamic.{name}: min ({bounds.min}) is greater than max ({bounds.max}); "
                    f"set dynamic.{name}.min <= dynamic.{name}.max."
                )

    def _check_cache(self) -> None:
        """A prefill must fit the cache: the seq bound at most `model.max_cache_len`."""
        model = self.model
        if not isinstance(model, CausalLmConfig) or model.max_cache_len is None:
            return
        seq = self.dynamic.get("seq")
        if seq is not None and seq.max > model.max_cache_len:
            raise ConfigError(
                f"dynamic.seq.max is {seq.max}, beyond model.max_cache_len ({model.max_cache_len})"
                ": a prefill must fit the cache. Lower dynamic.seq.max, raise "
                "model.max_cache_len, or leave it null (the seq bound's max)."
            )

    @property
    def atol(self) -> float:
        return self.backend.atol if self.validate.atol is None else self.validate.atol

    @property
    def rtol(self) -> float:
        return self.backend.rtol if self.validate.rtol is None else self.validate.rtol

    @property
    def factor(self) -> float:
        if self.validate.factor is None:
            return DEFAULT_FACTORS[self.model.dtype]
        return self.validate.factor
