"""The WebGPU runtime's .pte and Vulkan payload readers, on programs lowered here by ExecuTorch."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from executorch.backends.webgpu.partitioner import WebGPUPartitioner
from executorch.exir import to_edge, to_edge_transform_and_lower

from runtimes.formats.pte_file import (
    DelegateCall,
    KernelCall,
    Operator,
    PteFile,
    TensorValue,
    read_pte,
)
from runtimes.formats.vulkan_payload import (
    NAMED_DATA_OFFSET,
    VkGraph,
    VkTensor,
    read_vulkan_payload,
)

MAX_BATCH = 8


class Masked(torch.nn.Module):
    """A linear layer and a -inf mask, both delegated, beside a cumsum the delegate cannot run."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.relu(self.fc(x))
        return torch.where(y > 0, torch.full_like(y, float("-inf")), y), torch.cumsum(x, -1)


@pytest.fixture(scope="module")
def module() -> Masked:
    return Masked().eval()


@pytest.fixture(scope="module")
def pte_bytes(module: Masked) -> bytes:
    batch = torch.export.Dim("batch", min=2, max=MAX_BATCH)
    exported = torch.export.export(module, (torch.randn(2, 4),), dynamic_shapes={"x": {0: batch}})
    lowered = to_edge_transform_and_lower(exported, partitioner=[WebGPUPartitioner()])
    return lowered.to_executorch().buffer


@pytest.fixture(scope="module")
def pte(pte_bytes: bytes) -> PteFile:
    return read_pte(pte_bytes)


@pytest.fixture(scope="module")
def graph(pte: PteFile) -> VkGraph:
    return read_vulkan_payload(pte.plans[0].delegates[0].payload)


def test_plan_runs_the_cumsum_outside_and_the_rest_in_one_vulkan_delegate(pte: PteFile) -> None:
    (plan,) = pte.plans
    assert plan.name == "forward"
    assert plan.operators == (Operator("aten::cumsum", "out"),)
    assert [d.backend_id for d in plan.delegates] == ["VulkanBackend"]
    assert sorted(type(i).__name__ for i in plan.instructions) == ["DelegateCall", "KernelCall"]
    (cumsum,) = [i for i in plan.instructions if isinstance(i, KernelCall)]
    x, dim, dtype, out, _ = cumsum.args
    assert (x, plan.values[dim], plan.values[dtype]) == (plan.inputs[0], -1, None)
    assert out in plan.outputs


def test_inputs_and_outputs_are_tensors_sized_at_their_upper_bound(pte: PteFile) -> None:
    plan = pte.plans[0]
    tensors = [plan.values[i] for i in (*plan.inputs, *plan.outputs)]
    assert all(isinstance(t, TensorValue) for t in tensors)
    assert [(t.dtype, t.sizes, t.shape_dynamism, t.constant) for t in tensors] == [
        (torch.float32, (MAX_BATCH, 4), 1, None),
        (torch.float32, (MAX_BATCH, 3), 1, None),
        (torch.float32, (MAX_BATCH, 4), 1, None),
    ]
    assert tensors[0].dim_order == (0, 1)


def test_delegate_call_passes_the_graphs_inputs_then_outputs(pte: PteFile, graph: VkGraph) -> None:
    (call,) = [i for i in pte.plans[0].instructions if isinstance(i, DelegateCall)]
    assert call.delegate_index == 0
    assert len(call.args) == len(graph.input_ids) + len(graph.output_ids) == 2
    assert call.args[0] == pte.plans[0].inputs[0]


def test_vulkan_graph_chain(graph: VkGraph) -> None:
    assert [c.name for c in graph.chain] == [
        "aten.linear.default",
        "aten.relu.default",
        "aten.gt.Scalar",
        "aten.full_like.default",
        "aten.where.self",
    ]
    (x,) = [graph.values[i] for i in graph.input_ids]
    assert isinstance(x, VkTensor)
    assert (x.dtype, x.dims, x.constant_id) == ("float32", (MAX_BATCH, 4), -1)


def test_weights_are_named_data_holding_the_modules_bytes(
    module: Masked, pte: PteFile, graph: VkGraph
) -> None:
    constants = {
        v.dims: graph.constants[v.constant_id]
        for v in graph.values
        if isinstance(v, VkTensor) and v.constant_id >= 0
    }
    assert set(constants) == {(3, 4), (3,)}
    for dims, param in (((3, 4), module.fc.weight), ((3,), module.fc.bias)):
        constant = constants[dims]
        assert (constant.offset, constant.length) == (NAMED_DATA_OFFSET, param.numel() * 4)
        assert pte.named_data[constant.named_key] == param.detach().numpy().tobytes()


def test_a_negative_infinity_double_survives(graph: VkGraph) -> None:
    doubles = [v for v in graph.values if isinstance(v, float)]
    assert doubles == [-math.inf]


def test_constant_tensors_outside_delegates_hold_their_bytes(module: Masked) -> None:
    program = to_edge(torch.export.export(module.fc, (torch.randn(2, 4),))).to_executorch()
    plan = read_pte(program.buffer).plans[0]
    assert [f"{o.name}.{o.overload}" for o in plan.operators] == [
        "aten::permute_copy.out",
        "aten::addmm.out",
    ]
    constants = [v for v in plan.values if isinstance(v, TensorValue) and v.constant is not None]
    assert [(t.sizes, t.constant) for t in constants] == [
        ((3, 4), module.fc.weight.detach().numpy().tobytes()),
        ((3,), module.fc.bias.detach().numpy().tobytes()),
    ]


def test_a_truncated_pte_names_the_file(pte_bytes: bytes, tmp_path: Path) -> None:
    path = tmp_path / "cut.pte"
    path.write_bytes(pte_bytes[: len(pte_bytes) - 100])
    with pytest.raises(ValueError, match=rf"{path}: .*truncated"):
        read_pte(path)


def test_a_wrong_file_identifier_is_refused(pte_bytes: bytes) -> None:
    with pytest.raises(ValueError, match=r"file identifier is b'XX12', expected b'ET12'"):
        read_pte(pte_bytes[:4] + b"XX12" + pte_bytes[8:])


def test_a_bad_vulkan_payload_says_what_is_wrong(pte: PteFile) -> None:
    payload = pte.plans[0].delegates[0].payload
    with pytest.raises(ValueError, match=r"header magic is b'VX00', expected b'VH00'"):
        read_vulkan_payload(payload[:4] + b"VX00" + payload[8:])
    with pytest.raises(ValueError, match=r"flatbuffer region ends at \d+, past the 100 bytes"):
        read_vulkan_payload(payload[:100])
