"""The toy models, each composed as a user picks it (`model=<name>`) and built at its bounds."""

from __future__ import annotations

import dataclasses
from functools import cache

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from exporter import config, models
from exporter.config import ToyKind
from exporter.errors import ConfigError
from exporter.models import ModelBundle
from tests.conftest import CONF_DIR

TOYS = [kind.value for kind in ToyKind]
NORMS = ["rms_norm", "rms_norm_chain", "rms_norm_residual", "rms_norm_gated"]


@cache
def composed(*overrides: str) -> config.JobConfig:
    # Composing is the slow part of these tests: once per set of overrides. Never mutated.
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return config.to_job(compose("config", overrides=list(overrides)))


def built(*overrides: str) -> ModelBundle:
    """A fresh build of the composed toy: tests may change its weights."""
    job = composed(*overrides)
    return models.build(job.model, job.dynamic)


def outputs(bundle: ModelBundle, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        result = bundle.module(*inputs)
    return result if isinstance(result, tuple) else (result,)


# Per toy: its dim's name, bounds and axes, and its output shapes at the dim's min and max.
EXPECTED = {
    **{name: (("seq", 1, 128, (("x", 1),)), [(1, 1, 64)], [(1, 128, 64)]) for name in NORMS},
    "linear": (("m", 1, 64, (("x", 0),)), [(1, 48)], [(64, 48)]),
    "gqa_attention": (
        ("seq", 1, 128, (("q", 2), ("k", 2), ("v", 2))),
        [(1, 4, 1, 16)],
        [(1, 4, 128, 16)],
    ),
    "embedding": (("seq", 1, 128, (("ids", 1),)), [(1, 1, 64)], [(1, 128, 64)]),
    "rotary": (
        ("seq", 1, 128, (("q", 2), ("k", 2))),
        [(1, 4, 1, 16), (1, 2, 1, 16)],
        [(1, 4, 128, 16), (1, 2, 128, 16)],
    ),
}


def test_every_toy_kind_has_a_model_and_a_dynamic_file() -> None:
    assert sorted(EXPECTED) == sorted(TOYS)
    for name in TOYS:
        assert (CONF_DIR / "model" / f"{name}.yaml").is_file()
        assert (CONF_DIR / "dynamic" / f"{name}.yaml").is_file()


@pytest.mark.parametrize("name", TOYS)
def test_a_toy_runs_at_the_min_and_max_of_its_dim(name: str) -> None:
    (dim, low, high, axes), at_min, at_max = EXPECTED[name]
    bundle = built(f"model={name}")
    assert bundle.name == name
    assert [(d.name, d.min, d.max, d.axes) for d in bundle.dims] == [(dim, low, high, axes)]
    for size, shapes in ((low, at_min), (high, at_max)):
        inputs = bundle.make_inputs({dim: size}, 0)
        assert len(inputs) == len(bundle.input_names)
        result = outputs(bundle, inputs)
        assert len(result) == len(bundle.output_names)
        assert [tuple(y.shape) for y in result] == shapes


@pytest.mark.parametrize("name", TOYS)
def test_weights_and_inputs_are_seeded(name: str) -> None:
    first, again = built(f"model={name}"), built(f"model={name}")
    job = composed(f"model={name}")
    other = models.build(dataclasses.replace(job.model, seed=1), job.dynamic)
    sizes = first.max_sizes()
    for a, b in zip(first.make_inputs(sizes, 3), again.make_inputs(sizes, 3), strict=True):
        assert torch.equal(a, b)
    inputs = first.make_inputs(sizes, 3)
    assert not torch.equal(inputs[0], first.make_inputs(sizes, 4)[0])
    assert torch.equal(outputs(first, inputs)[0], outputs(again, inputs)[0])
    # Attention and rotary have no weights; the seed changes every other toy's.
    if list(first.module.parameters()):
        assert not torch.equal(outputs(first, inputs)[0], outputs(other, inputs)[0])


@pytest.mark.parametrize("name", NORMS)
def test_rms_norm_weights_are_not_all_ones(name: str) -> None:
    weights = [p for n, p in built(f"model={name}").module.named_parameters() if "weight" in n]
    assert len(weights) == (2 if name == "rms_norm_chain" else 1)
    for weight in weights:
        assert weight.shape == (64,)
        assert 0.05 < weight.std().item() < 0.2
        assert abs(weight.mean().item() - 1) < 0.05
    if len(weights) == 2:
        assert not torch.equal(weights[0], weights[1])


def test_rms_norm_rows_have_the_rms_of_the_weight() -> None:
    bundle = built("model=rms_norm")
    (x,) = bundle.make_inputs({"seq": 128}, 0)
    (y,) = outputs(bundle, (x * 5 + 2,))
    weight = bundle.module.weight.detach()
    # Divided by its weight, each row is a unit-RMS vector whatever the input's scale.
    assert torch.allclose((y / weight).pow(2).mean(-1), torch.ones(1, 128), atol=1e-4)
    with torch.no_grad():
        bundle.module.weight.fill_(1.0)
    (y,) = outputs(bundle, (x * 5 + 2,))
    assert torch.allclose(y.pow(2).mean(-1), torch.ones(1, 128), atol=1e-4)


def test_the_norm_variants_compose_the_norm_as_named() -> None:
    (x,) = built("model=rms_norm").make_inputs({"seq": 7}, 0)
    chain = built("model=rms_norm_chain").module
    residual = built("model=rms_norm_residual").module
    gated = built("model=rms_norm_gated").module
    with torch.no_grad():
        assert torch.equal(chain(x), chain.second(chain.first(x)))
        assert torch.equal(residual(x), residual.norm(x) + x)
        assert torch.equal(gated(x), gated.norm(x) * x)


def test_linear_is_an_affine_map_with_a_bias() -> None:
    bundle = built("model=linear")
    (x,) = bundle.make_inputs({"m": 5}, 0)
    layer = bundle.module
    assert (layer.in_features, layer.out_features) == (64, 48)
    assert layer.bias.abs().sum() > 0
    (y,) = outputs(bundle, (x,))
    assert torch.allclose(y, x @ layer.weight.T + layer.bias, atol=1e-5)


def test_embedding_ids_are_int64_within_the_vocab() -> None:
    bundle = built("model=embedding", "model.vocab=7")
    (ids,) = bundle.make_inputs({"seq": 128}, 0)
    assert ids.dtype == torch.int64
    assert ids.shape == (1, 128)
    assert ids.min().item() >= 0 and ids.max().item() <= 6
    # 128 draws from 7 ids reach both ends of the range.
    assert set(ids.unique().tolist()) == set(range(7))
    (y,) = outputs(bundle, (ids,))
    assert torch.equal(y[0], bundle.module.weight[ids[0]])


def test_causal_attention_first_position_reads_the_first_value_of_its_kv_group() -> None:
    bundle = built("model=gqa_attention")
    q, k, v = bundle.make_inputs({"seq": 16}, 0)
    (y,) = outputs(bundle, (q, k, v))
    # heads=4 over kv_heads=2: query heads 0 and 1 read kv head 0, heads 2 and 3 kv head 1.
    for head, kv_head in enumerate((0, 0, 1, 1)):
        assert torch.allclose(y[0, head, 0], v[0, kv_head, 0], atol=1e-6)
    assert not torch.allclose(y[0, 0, 1], v[0, 0, 1], atol=1e-3)


def test_attention_heads_must_be_a_multiple_of_kv_heads() -> None:
    with pytest.raises(ConfigError, match=r"model.heads \(4\) is not a multiple of .*\(3\)"):
        built("model=gqa_attention", "model.kv_heads=3")


def test_rotary_rotates_q_and_k_by_position() -> None:
    bundle = built("model=rotary")
    q, k = bundle.make_inputs({"seq": 128}, 0)
    q_rot, k_rot = outputs(bundle, (q, k))
    assert bundle.output_names == ("q_rot", "k_rot")
    assert (q_rot.shape, k_rot.shape) == (q.shape, k.shape)
    # Position 0 has angle 0; every position keeps the length of each rotated pair.
    assert torch.equal(q_rot[:, :, 0], q[:, :, 0])
    assert torch.equal(k_rot[:, :, 0], k[:, :, 0])
    assert not torch.allclose(q_rot[:, :, 1], q[:, :, 1], atol=1e-3)

    def pair_norms(t: torch.Tensor) -> torch.Tensor:
        return t[..., :8].pow(2) + t[..., 8:].pow(2)

    assert torch.allclose(pair_norms(q_rot), pair_norms(q), atol=1e-4)
    assert torch.allclose(pair_norms(k_rot), pair_norms(k), atol=1e-4)
    assert bundle.module.cos.shape == bundle.module.sin.shape == (128, 16)


def test_rotary_seq_beyond_max_positions_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"dynamic\.seq\.max is 129, beyond .* \(128\)"):
        built("model=rotary", "dynamic.seq.max=129")
    bundle = built("model=rotary", "model.max_positions=256", "dynamic.seq.max=256")
    assert bundle.dims[0].max == 256


def test_an_unknown_toy_kind_fails_at_compose_time() -> None:
    with pytest.raises(ConfigCompositionException) as error:
        built("model=rms_norm", "model.kind=conv")
    assert "rms_norm_chain" in str(error.value.__cause__)
