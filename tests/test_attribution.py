"""quantize.attribution: each layer quantized alone, ranked by the quality it costs; the worst
one kept float by quantize.skip."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

from exporter.config import QuantizeConfig, QuantScheme
from exporter.models import DynamicDim, ModelBundle
from exporter.quantize import quantized
from exporter.quantize.attribution import attribute
from exporter.quantize.packed import PackedLinear
from exporter.quantize.quality import next_token


def three_layers(outlier_layer: str, before: str) -> ModelBundle:
    """Three linear layers to 64 logits. `outlier_layer` gets a huge weight at the start of each
    group of 32 inputs, on an input that `before` (the layer feeding it) leaves at 0: the float
    model never feels it, while int4's per-group scale is set by it, so the rest of each group
    rounds to 0 and that layer's quantization error dominates."""
    torch.manual_seed(0)
    module = torch.nn.Sequential()
    module.add_module("up", torch.nn.Linear(32, 64))
    module.add_module("mid", torch.nn.Linear(64, 64))
    module.add_module("head", torch.nn.Linear(64, 64))
    with torch.no_grad():
        module.get_submodule("head").weight *= 8.0
        feeding = module.get_submodule(before)
        feeding.weight[::32] = 0.0
        feeding.bias[::32] = 0.0
        module.get_submodule(outlier_layer).weight[:, ::32] = 100.0

    def make_inputs(sizes: Mapping[str, int], seed: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(seed)
        return (torch.randn(sizes["batch"], 32, generator=generator),)

    return ModelBundle(
        name="three_layers",
        module=module.eval(),
        input_names=("x",),
        output_names=("logits",),
        dims=(DynamicDim("batch", (("x", 0),), 1, 16),),
        make_inputs=make_inputs,
        logits_outputs=("logits",),
    )


def test_the_layer_whose_quantization_error_dominates_ranks_first_and_skip_keeps_it_float() -> None:
    cfg = QuantizeConfig(scheme=QuantScheme("int4_weight"))
    for worst, before in (("mid", "up"), ("head", "mid")):
        bundle = three_layers(worst, before)
        (inputs,) = bundle.make_inputs({"batch": 16}, 1)

        def run(module: torch.nn.Module = bundle.module, x: torch.Tensor = inputs) -> list:
            with torch.no_grad():
                return [module(x)]

        found = attribute(bundle.module, run, cfg)
        assert found.layers[0].name == worst
        assert len(found.layers) == 3
        first, second = found.layers[0].quality, found.layers[1].quality
        assert first.kld_mean > 5 * second.kld_mean
        assert found.override(1) == f"quantize.skip=[{worst}]"
        # The float model is left as it was.
        assert type(bundle.module.get_submodule(worst).weight) is torch.nn.Parameter

        # The model quantized with the worst layer skipped: that layer stays float, and the
        # quality lost falls.
        float_logits = run()[0]
        everything = quantized(bundle, cfg).module
        kept = quantized(bundle, QuantizeConfig(scheme=cfg.scheme, skip=[worst])).module
        assert type(kept.get_submodule(worst).weight) is torch.nn.Parameter
        assert type(everything.get_submodule(worst).weight) is not torch.nn.Parameter
        assert torch.equal(
            kept.get_submodule(worst).weight, bundle.module.get_submodule(worst).weight
        )
        lost_all = next_token(float_logits, run(everything)[0]).kld_mean
        lost_kept = next_token(float_logits, run(kept)[0]).kld_mean
        assert lost_kept < lost_all / 5


def test_a_backend_of_the_int4_kernel_has_each_layer_attributed_as_its_kernel_quantizes_it() -> (
    None
):
    cfg = QuantizeConfig(scheme=QuantScheme("int4_weight"))
    bundle = three_layers("mid", "up")
    (inputs,) = bundle.make_inputs({"batch": 16}, 1)

    def run(module: torch.nn.Module = bundle.module, x: torch.Tensor = inputs) -> list:
        with torch.no_grad():
            return [module(x)]

    found = attribute(bundle.module, run, cfg, int4_weight_packed=True)
    assert found.layers[0].name == "mid" and len(found.layers) == 3
    # Each layer's cost is that of the int4 kernel's layer alone, as the quantize stage makes
    # it for such a backend, not torchao's.
    float_logits = run()[0]
    model = quantized(bundle, cfg, None, int4_weight_packed=True).module
    assert all(isinstance(model.get_submodule(n), PackedLinear) for n in ("up", "mid", "head"))
    alone = copy.deepcopy(bundle.module)
    alone.set_submodule("mid", model.get_submodule("mid"))
    assert found.layers[0].quality.kld_mean == next_token(float_logits, run(alone)[0]).kld_mean
    torchao = attribute(bundle.module, run, cfg).layers[0].quality.kld_mean
    assert torchao != found.layers[0].quality.kld_mean
