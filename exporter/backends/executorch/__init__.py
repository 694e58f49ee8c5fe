"""ExecuTorch with the XNNPACK delegate: exported program -> edge dialect -> partitioned -> .pte,
run by ExecuTorch's runtime on the CPU.

The program is first rewritten into ops XNNPACK takes
(exporter/backends/common/xnnpack_rewrites.py), and with `fallback.wrong_kernels=avoid` (the
default) the ops XNNPACK computes as another function into ops it computes right; the fallback
policy maps onto XNNPACK's partitioner (exporter/backends/executorch/xnnpack_partitioner.py).
`external_weights` puts the weights into model.ptd beside model.pte
(exporter/backends/common/executorch_program.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from exporter.artifact import Artifact, Output, WeightsReader
from exporter.backends.common.declaration import Backend
from exporter.config import BackendConfig, FallbackConfig, LlmOps, QuantScheme, WrongKernels

if TYPE_CHECKING:
    from exporter.export import Exported


@dataclass
class ExecutorchConfig(BackendConfig):
    # XNNPACK's dynamically quantized linear kernels (int8 activations per token) take these
    # with every linear delegated; measured on one nn.Linear(64, 96) against the float64 oracle
    # of the quantized layer: 8da8w 1.5e-7, 8da4w 1.4e-7 once its scales are bfloat16 (the
    # quantize stage rounds them: Executorch.group_scales).
    quant_schemes: ClassVar[tuple[QuantScheme, ...]] = (
        QuantScheme.none,
        QuantScheme("8da4w"),
        QuantScheme("8da8w"),
        QuantScheme("auto"),
    )
    # ExecuTorch's edge dialect refuses the symbolic arithmetic that computes the asserts, which
    # its decomposition puts back however often they are removed.
    runtime_guards_refusal: ClassVar[str] = (
        "ExecuTorch's edge dialect refuses the arithmetic that computes them"
    )
    encode_method_refusal: ClassVar[str] = ""
    quant_refusal: ClassVar[str] = (
        "XNNPACK takes torchao's weight-only int8 and int4 linear layers without an error and "
        "computes garbage (one nn.Linear(64, 96): off by 2.1e3 and 1.3e2 where its outputs are "
        "at most 2); a quantized embedding does not lower (XNNPACK takes no embedding lookup, "
        "and ExecuTorch's runtime has no kernel for torchao's dequantize op). Use 8da4w or "
        "8da8w with quantize.embedding=none here, or backend=aoti or eager for the others."
    )
    name: str = "executorch"
    atol: float = 1.0e-4
    rtol: float = 1.0e-3
    # Weights in model.ptd, beside a model.pte that holds the program only: for weights past
    # what one flatbuffer addresses (2 GB), and a data file the runtime can map.
    external_weights: bool = False
    # A static KV cache's ops (model.kv_cache=static): ExecuTorch's LLM ops (custom), or
    # transformers' own (plain). A .pte with the custom ops loads where ExecuTorch's custom-ops
    # library is imported (runtimes/loaders/executorch.py imports it).
    llm_ops: LlmOps = LlmOps.custom

    def quantize_recipes(self) -> tuple[str, ...]:
        return ("8da4w", "8da8w", "float")


# How its artifacts compute at a half dtype where that costs precision eager does not lose,
# as measured by bench/half_accumulation.py; a half-precision failure's message says it.
HALF_PRECISION = {
    "float16": (
        "At float16, XNNPACK's arithmetic is not eager's: its matrix products sum in float32 as "
        "eager's do (one nn.Linear, inner dims 64 to 2048, 1 to 64 rows: eager's error exactly, "
        "on an x86 CPU without float16 arithmetic), but this lowering computes attention as "
        "bmm, softmax, bmm with the scores and weights rounded to float16 between them, where "
        "eager's scaled_dot_product_attention keeps them in float32 (one attention: 3 to 7 "
        "times eager's error at seq 16 to 128), and its float16 activations round each step "
        "(a trained 135M Llama: 1.0 to 3.9 times eager's error, 2.2 at seq 1 where attention "
        "is exact). Such errors are the backend's precision, not a fault of the model; the "
        "next-token predictions say whether they matter."
    ),
}


class Executorch(Backend):
    """ExecuTorch itself is one of the project's dependencies and XNNPACK is its CPU delegate:
    nothing to check; its version is among the libraries its lowering code imports, so no
    toolchain besides."""

    def output(self, config: ExecutorchConfig) -> Output:
        return Output(
            file="model.pte",
            runtime=self.runtime,
            audit=self.audit,
            device="cpu",
            data_file="model.ptd" if config.external_weights else None,
        )

    def llm_ops(self, config: ExecutorchConfig) -> LlmOps:
        return config.llm_ops

    def lower(
        self, exported: Exported, config: ExecutorchConfig, fallback: FallbackConfig, out_dir: Path
    ) -> Artifact:
        from exporter.backends.common.executorch_program import announced_policy, lowered_to_pte
        from exporter.backends.common.xnnpack_rewrites import (
            ViewsForXnnpack,
            for_xnnpack,
            without_wrong_kernels,
        )
        from exporter.backends.executorch.tied_embedding import UntiedEmbedding
        from exporter.backends.executorch.xnnpack_partitioner import PolicyPartitioner

        partitioner = PolicyPartitioner(announced_policy("XNNPACK", fallback, exported))
        program = for_xnnpack(exported.program)
        encode = None if exported.encode is None else for_xnnpack(exported.encode)
        avoided = ()
        if fallback.wrong_kernels is WrongKernels.avoid:
            program, avoided = without_wrong_kernels(program)
        return lowered_to_pte(
            replace(exported, program=program, encode=encode),
            partitioner,
            partitioner.why_on_cpu,
            self.output(config),
            out_dir,
            edge_passes=[ViewsForXnnpack(), UntiedEmbedding()],
            wrong_kernels_avoided=avoided,
        )


BACKEND = Executorch(
    schema=ExecutorchConfig,
    runtime="executorch",
    delegate="XNNPACK",
    audit=WeightsReader.pte,
    half_precision=HALF_PRECISION,
    # XNNPACK's 4-bit blockwise kernels keep each group's scale as a bfloat16: a one-layer
    # Llama's 8da4w artifact was off by 3.6e-3 to 4.9e-3 from the quantized model with its
    # float32 scales (eager: 2e-7), and within eager's error once they were rounded (but where
    # an activation sat on a near tie: docs/quantization.md).
    group_scales="bfloat16",
)
