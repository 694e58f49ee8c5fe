"""validate.localize: a failed job names the first node of its exported program that diverges.

Each test plants a bug where users meet them: a graph rewrite in lowering that is wrong only
below the upper bound (a size baked in), a runtime kernel that keeps its upper-bound shape. The
job runs in-process, through its stages, so the bug can be planted into the very lowering code
the job calls. An artifact changed after lowering: tests/test_tampered_artifacts.py."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.export import ExportedProgram

from exporter import config
from exporter.localize import source_line
from exporter.localize.cut import cut, tensor_nodes
from exporter.localize.node_values import node_values
from exporter.models import ModelBundle
from tests.conftest import composed, job_in_process, run_exporter
from tests.test_cli import assert_user_error

TOYS = Path(__file__).resolve().parents[1] / "exporter" / "models" / "toys.py"


def node_named(program: ExportedProgram, op: str, module: str) -> torch.fx.Node:
    """The node of `op` called by the module at `module` (its path in nn_module_stack)."""
    (node,) = [
        n
        for n in tensor_nodes(program)
        if n.target == op and list(n.meta["nn_module_stack"].values())[-1][0].endswith(module)
    ]
    return node


def wrong_below_the_bound(name: str, upper: int) -> Callable[[ExportedProgram], ExportedProgram]:
    """A graph rewrite with the upper bound baked in: the node `name` comes out scaled by
    seq / upper, right at the bound and wrong below it. Programs without the node pass as
    they are (a cut made before it)."""

    def rewrite(program: ExportedProgram) -> ExportedProgram:
        graph = program.graph_module.graph
        for node in graph.nodes:
            if node.name != name:
                continue
            dim = next(
                i for i, s in enumerate(node.meta["val"].shape) if isinstance(s, torch.SymInt)
            )
            with graph.inserting_after(node):
                size = graph.call_function(torch.ops.aten.sym_size.int, (node, dim))
            with graph.inserting_after(size):
                scaled = graph.call_function(torch.ops.aten.mul.Tensor, (node, size))
            with graph.inserting_after(scaled):
                wrong = graph.call_function(torch.ops.aten.div.Tensor, (scaled, upper))
            # What passes after it read these (XNNPACK's rewrites do).
            size.meta["val"] = node.meta["val"].shape[dim]
            scaled.meta["val"] = wrong.meta["val"] = node.meta["val"]
            keep = (size, scaled)
            node.replace_all_uses_with(wrong, delete_user_cb=lambda u, keep=keep: u not in keep)
            program.graph_module.recompile()
        return program

    return rewrite


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelBundle, ExportedProgram]:
    """The default Llama and its exported program, exported once for the tests that read or cut
    it: cuts copy the program, and the planted rewrites change copies of the cut parts."""
    from exporter import export, models

    job = config.to_job(composed("model=llama"))
    bundle = models.build(job.model, job.dynamic)
    exported = export.run(bundle, job.export, tmp_path_factory.mktemp("llama"))
    return bundle, exported.program


@pytest.fixture(scope="module")
def chain_program(tmp_path_factory: pytest.TempPathFactory) -> ExportedProgram:
    from exporter import export, models

    job = config.to_job(composed("model=rms_norm_chain"))
    bundle = models.build(job.model, job.dynamic)
    return export.run(bundle, job.export, tmp_path_factory.mktemp("chain")).program


def test_a_cut_program_returns_the_nodes_it_was_cut_after(chain_program: ExportedProgram) -> None:
    rsqrt = node_named(chain_program, torch.ops.aten.rsqrt.default, "second")
    part = cut(chain_program, [rsqrt.name])
    x = torch.randn(1, 5, 64)
    (value,) = part.module()(x)
    wide, narrow = node_values(chain_program, (x,), [rsqrt.name])[rsqrt.name]
    assert value.shape == (1, 5, 1)
    assert torch.equal(value, narrow)
    assert wide.dtype == torch.float64
    assert torch.allclose(wide, narrow.double(), rtol=1e-5)
    # The second norm's weight is after the cut: the part does not carry it.
    assert sorted(part.state_dict) == ["first.weight"]


def test_a_cut_after_the_first_norm_keeps_nothing_after_it(
    llama: tuple[ModelBundle, ExportedProgram],
) -> None:
    """The default Llama casts in every norm and calls scaled_dot_product_attention, which torch
    counts as impure: neither keeps the later layers in a cut before them."""
    _, program = llama
    nodes = tensor_nodes(program)
    norm = node_named(program, torch.ops.aten.rsqrt.default, "0.input_layernorm")
    part = cut(program, [norm.name])
    kept = [node.name for node in tensor_nodes(part)]
    assert len(kept) <= [node.name for node in nodes].index(norm.name) + 1
    assert sorted(part.state_dict) == ["model.model.embed_tokens.weight"]


# AOTInductor compiles C++ for each lowering: about 40 s here.
@pytest.mark.parametrize("backend", ["executorch", pytest.param("aoti", marks=pytest.mark.slow)])
def test_a_rewrite_wrong_below_the_bound_is_named_with_its_source_line(
    backend: str,
    chain_program: ExportedProgram,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    planted = node_named(chain_program, torch.ops.aten.rsqrt.default, "second").name
    rewrite = wrong_below_the_bound(planted, upper=128)
    if backend == "executorch":
        from exporter.backends.common import xnnpack_rewrites

        for_xnnpack = xnnpack_rewrites.for_xnnpack
        monkeypatch.setattr(xnnpack_rewrites, "for_xnnpack", lambda p: rewrite(for_xnnpack(p)))
    else:
        from exporter.backends import aoti

        package = aoti.package
        monkeypatch.setattr(
            aoti,
            "package",
            lambda program, *args, **kwargs: package(rewrite(program), *args, **kwargs),
        )
    record, report = job_in_process(tmp_path / "run", "model=rms_norm_chain", f"backend={backend}")

    assert record.exit_code == 1
    failed = [s["shape"]["seq"] for s in report["shapes"] if not s["passed"]]
    assert failed and max(failed) < 128
    found = report["first_divergence"]
    assert found["reproduced"] is True
    assert (found["node"], found["op"]) == (planted, "aten.rsqrt.default")
    assert found["module"] == "second (RmsNorm)"
    line = next(
        number
        for number, text in enumerate(TOYS.read_text().splitlines(), start=1)
        if "torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)" in text
    )
    assert found["source"].startswith(f"{TOYS}:{line} in forward:")
    assert found["shape"]["seq"] in failed
    assert found["error"]["within"] is False
    assert found["error"]["max_abs"] > 1e3 * found["error"]["ref_max_abs"]
    # What feeds it is within the rule: the add of the second norm's mean and eps.
    assert [i["op"] for i in found["inputs"]] == ["aten.add.Tensor"]
    assert all(i["within"] for i in found["inputs"])
    # The job lowered the artifact itself: the search does not lower the whole program again,
    # and its 11 nodes are few enough for one lowering to cut after each.
    assert found["lowerings"] == 1
    assert found["relowering"] == (
        "the whole program was not lowered again: this job lowered the artifact from this "
        "program in this run"
    )
    assert record.localization is not None
    assert record.localization.summary() == f"{planted} (aten.rsqrt.default)"


@pytest.fixture
def reduction_keeps_its_upper_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The WebGPU runtime's reduction kernels with their resize rule disabled (the oracle test's
    fault in tests/test_webgpu.py): their output keeps the upper bound's shape."""
    from runtimes.loaders.webgpu.kernels.reduction import Reduction

    def keep_upper_bound(op: Reduction) -> None:
        op.out.set_dims(op.out.max_dims, op.name)

    monkeypatch.setattr(Reduction, "resize", keep_upper_bound)


@pytest.mark.usefixtures("reduction_keeps_its_upper_bound")
def test_a_webgpu_kernel_that_keeps_its_upper_bound_shape_is_named(tmp_path: Path) -> None:
    record, report = job_in_process(tmp_path / "run", "model=rms_norm", "backend=webgpu")

    assert record.exit_code == 1
    found = report["first_divergence"]
    assert found["reproduced"] is True
    assert (found["op"], found["module"]) == ("aten.mean.dim", "RmsNorm")
    assert found["shape"]["seq"] < 128
    # Its output keeps the upper bound's shape: no value of it compares.
    assert found["error"]["max_abs"] == "inf"
    assert found["error"]["shape"] == [1, 128, 1]
    assert found["error"]["expected_shape"] == [1, found["shape"]["seq"], 1]
    assert record.localization is not None
    assert f"  its shape: (1, 128, 1) where eager's is (1, {found['shape']['seq']}, 1)" in (
        record.localization.lines()
    )
    assert all(i["within"] for i in found["inputs"])


# eager ships the program itself: a part the search cut is saved for it to run.
@pytest.mark.parametrize("backend", ["executorch", "eager"])
def test_always_searches_a_passing_job_which_then_names_nothing(
    backend: str, tmp_path: Path
) -> None:
    result = run_exporter(
        tmp_path, "model=mlp", f"backend={backend}", "validate.localize=always", "benchmark=off"
    )
    assert result.exit_code == 0, result.output
    found = result.report()["first_divergence"]
    assert found["reproduced"] is None
    assert found["reason"].startswith("validation passed; at its worst execution, at batch=")
    assert "no output diverges beyond the rule" in found["reason"]
    (run,) = result.mlflow_runs()
    assert run.data.tags["diverged_at"] == "not localized"
    assert run.data.metrics["localize_s"] > 0


@pytest.mark.usefixtures("reduction_keeps_its_upper_bound")
def test_off_leaves_a_failed_job_without_a_search(tmp_path: Path) -> None:
    record, report = job_in_process(
        tmp_path / "run", "model=rms_norm", "backend=webgpu", "validate.localize=off"
    )
    assert record.exit_code == 1
    assert "first_divergence" not in report
    assert "localize" not in record.seconds


def test_an_unknown_localize_mode_is_refused_naming_the_key(tmp_path: Path) -> None:
    result = run_exporter(tmp_path, "validate.localize=sometimes")
    assert_user_error(result, 2, "validate.localize", "auto", "always", "off")


@pytest.mark.parametrize("seconds", ["0", "-5"])
def test_a_budget_of_no_time_is_refused_naming_the_key(seconds: str, tmp_path: Path) -> None:
    result = run_exporter(tmp_path, f"validate.localize_seconds={seconds}")
    assert_user_error(
        result, 2, f"validate.localize_seconds is {seconds}", "more than 0", "null for no limit"
    )


def test_a_search_out_of_budget_still_ends_with_the_validation_verdict(tmp_path: Path) -> None:
    """No tolerance at all: the norm's XNNPACK artifact fails against float64 everywhere. The
    job's own lowering took longer than the budget, so the search stops before its first."""
    result = run_exporter(
        tmp_path,
        "model=rms_norm",
        "backend=executorch",
        "validate.rule=absolute",
        "validate.atol=0",
        "validate.rtol=0",
        "validate.localize_seconds=0.001",
        "benchmark=off",
    )
    assert result.exit_code == 1, result.output
    found = result.report()["first_divergence"]
    assert found["reproduced"] is None
    assert found["budget_hit"] is True
    assert found["lowerings"] == 0
    # Nothing narrowed: every node up to the output is still in question.
    nodes = tensor_nodes(torch.export.load(result.run_dir / "program.pt2"))
    assert (found["after"], found["up_to"]) == ("", nodes[-1].name)
    assert found["nodes"] == len(nodes)
    assert found["budget_seconds"] == 0.001
    assert found["next_lowering_seconds"] > 0.001
    assert "not localized within validate.localize_seconds=0.001" in result.output
    assert f"narrowed at seq={found['shape']['seq']} to {len(nodes)} nodes" in result.output
    (run,) = result.mlflow_runs()
    assert run.data.tags["diverged_at"] == (
        f"budget hit: {len(nodes)} nodes after the inputs up to {nodes[-1].name}"
    )
    assert run.data.tags["status"] == "failed"


def test_a_search_out_of_budget_says_what_it_narrowed_down_to(
    llama: tuple[ModelBundle, ExportedProgram], tmp_path: Path
) -> None:
    """A backend whose lowering takes 40 ms a node: the first cut (the front sixteenth) runs,
    and the next, four times longer, would take the search past its second."""
    from exporter.localize import Narrowed, Replay, localize
    from exporter.validate import Tolerances, goldens, judge

    bundle, program = llama
    nodes = tensor_nodes(program)
    planted = node_named(program, torch.ops.aten.rsqrt.default, "1.post_attention_layernorm")
    rewrite = wrong_below_the_bound(planted.name, upper=128)
    shape = {"seq": 127}
    expected = goldens.compute(bundle, [shape], 0, "cpu")
    rule = Tolerances("reference", 1e-4, 1e-3, factor=5.0, floor=1e-5)

    def lower(part: ExportedProgram, folder: Path) -> Callable[[], _Module]:
        time.sleep(0.04 * len(tensor_nodes(part)))
        planted = rewrite(copy.deepcopy(part))
        return lambda: _Module(planted)

    def fails(outputs: tuple[torch.Tensor, ...]) -> bool:
        return not all(s.within for s in judge(("logits",), outputs, shape, expected, rule))

    replay = Replay(((expected.cases["seq=127"][0], False),), shape)
    found = localize(
        program,
        lower,
        replay,
        fails,
        rule,
        tmp_path / "search",
        lowered_now="the test lowered it",
        budget_seconds=1.0,
    )
    assert isinstance(found, Narrowed)
    # The front sixteenth was lowered and is within; the rest, up to the logits, is in question.
    assert found.lowerings == 1
    first_cut = math.ceil(len(nodes) / 16)
    (logits,) = program.graph.output_node().all_input_nodes
    output = [n.name for n in nodes].index(logits.name)
    assert (found.after, found.up_to) == (nodes[first_cut - 1].name, logits.name)
    assert found.up_to_module == "model.lm_head (Linear)"
    assert found.nodes == output + 1 - first_cut
    assert found.seconds + found.next_lowering_seconds > 1.0
    assert "budget hit:" in found.summary()


def test_a_layers_source_line_is_the_models_call_not_torchs_forward(
    llama: tuple[ModelBundle, ExportedProgram],
) -> None:
    _, program = llama
    linear = torch.ops.aten.linear.default
    linears = [node for node in tensor_nodes(program) if node.target == linear]
    # 7 projections in each of 2 layers, and the head.
    assert len(linears) == 15
    # The innermost frame is nn.Linear's forward, in torch; the line named is the model's call.
    sources = [source_line(node) for node in linears]
    assert all("/transformers/models/llama/modeling_llama.py:" in s for s in sources)
    assert "down_proj = self.down_proj(" in sources[6]


class _Module:
    """A program run by torch: the search's artifact where the test is its own backend."""

    def __init__(self, program: ExportedProgram) -> None:
        self.module = program.module()

    def run(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return tuple(torch.utils._pytree.tree_leaves(self.module(*inputs)))


def test_an_error_a_norms_mean_averages_under_the_floor_is_traced_above_it(
    llama: tuple[ModelBundle, ExportedProgram], tmp_path: Path
) -> None:
    """A bug in the rotary embedding reaches the next norm at 2e-5 of its scale; the norm's
    mean averages that under the rule's floor (1e-5) and its rsqrt amplifies it past the rule
    again. The node named is the rotary mul, not the rsqrt whose inputs are within."""
    from exporter.localize import Replay, localize
    from exporter.validate import Tolerances, goldens, judge

    bundle, program = llama
    rotary_mul = "mul_8"
    assert "apply_rotary_pos_emb" in source_line(
        next(n for n in tensor_nodes(program) if n.name == rotary_mul)
    )
    rewrite = wrong_below_the_bound(rotary_mul, upper=128)
    shape = {"seq": 127}
    expected = goldens.compute(bundle, [shape], 0, "cpu")
    rule = Tolerances("reference", 1e-4, 1e-3, factor=5.0, floor=1e-5)

    def lower(part: ExportedProgram, folder: Path) -> Callable[[], _Module]:
        planted = rewrite(copy.deepcopy(part))
        return lambda: _Module(planted)

    def fails(outputs: tuple[torch.Tensor, ...]) -> bool:
        return not all(s.within for s in judge(("logits",), outputs, shape, expected, rule))

    replay = Replay(((expected.cases["seq=127"][0], False),), shape)
    found = localize(program, lower, replay, fails, rule, tmp_path / "search")
    assert found.summary() == f"{rotary_mul} (aten.mul.Tensor)"
