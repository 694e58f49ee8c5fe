"""Runs an AOTInductor package (.pt2) with torch's own loader, on the device it was compiled for;
on CUDA, its calls replayed as CUDA graphs (runtimes/cuda_graphs.py). A package with a decode
step (exporter/backends/aoti.py) runs the calls of its shapes with it, every other call with the
model; both read the same weights and KV cache."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch._inductor import aoti_load_package

from runtimes import int4_kernels
from runtimes.cuda_graphs import CudaGraphs
from runtimes.on_device import OnDevice

# The distributions it loads artifacts with, whose versions a check's report records.
PACKAGES = ("torch",)

# Where the compiler records the package's device in its metadata.
_DEVICE_KEY = "AOTI_DEVICE_KEY"
# The package's models: the program as exported, and its one-token call compiled apart, whose
# metadata holds that call's input shapes (a JSON list of lists) under CALL_SHAPES.
MODEL = "model"
DECODE_STEP = "decode_step"
CALL_SHAPES = "call_shapes"
# A decoder's encode method (Whisper's), where the package has one: it writes the state (the
# cross-attention cache) that the model then reads, the same tensors.
ENCODE = "encode"


def load(path: Path, device: str) -> AotiPackage:
    return AotiPackage(path, device)


class AotiPackage(OnDevice):
    def __init__(self, path: Path, device: str = "cpu") -> None:
        _share_libstdcxx()
        on = torch.device(device)
        graphed = on.type == "cuda"
        models = _load(path, single_threaded=graphed)
        compiled_for = models[MODEL].get_metadata().get(_DEVICE_KEY, on.type)
        if compiled_for != on.type:
            raise ValueError(f"{path} was compiled for {compiled_for}, not for {device}")
        int4_kernels.require_packing(
            models[MODEL].get_metadata().get(int4_kernels.PACKING_KEY), path
        )
        call = calls(models)
        super().__init__(CudaGraphs(call) if graphed else call, on, models.get(ENCODE))


def calls(models: dict[str, Callable[..., object]]) -> Callable[..., object]:
    """What runs a call of the package: its decode step for calls of that step's shapes, where it
    has one; the model for every other call."""
    model, step = models[MODEL], models.get(DECODE_STEP)
    if step is None:
        return model
    step_shapes = [tuple(shape) for shape in json.loads(step.get_metadata()[CALL_SHAPES])]

    def call(*inputs: object) -> object:
        shapes = [tuple(getattr(x, "shape", ())) for x in inputs]
        return (step if shapes == step_shapes else model)(*inputs)

    return call


def _load(path: Path, single_threaded: bool) -> dict[str, Callable[..., object]]:
    """The package's models by name. A package whose weights are pickled beside the .so
    (exporter/backends/aoti.py) needs them loaded from the archive and handed to its models,
    which use them in place (user_managed): one copy of the weights, which a decode step shares
    with the model. `aoti_load_package` leaves them out.

    `single_threaded` runs calls without the runtime's bookkeeping of concurrent calls, which a
    CUDA graph cannot hold: before each call it asks whether the last one's event has completed,
    and an event recorded during a capture fails every such question after it."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        pickled = any(name.endswith("weights_config.json") for name in archive.namelist())
    if not pickled:
        return {MODEL: aoti_load_package(str(path), run_single_threaded=single_threaded)}
    from torch.export.pt2_archive._package import load_pt2

    loaded = load_pt2(str(path), load_weights_from_disk=True, run_single_threaded=single_threaded)
    return loaded.aoti_runners


def _share_libstdcxx() -> None:
    """A package's wrapper.so does not list libstdc++ among the libraries it needs, so its C++
    standard-library references bind to whatever the process already exposes. With torch 2.11's
    CUDA wheels (libtorch built by Red Hat's devtoolset GCC) they bound to libtorch's own copies
    of std::regex code, mixed with the system libstdc++'s locale facets, and loading crashed with
    SIGSEGV in the package's parse_device_str. Making the system's libstdc++ global before the
    load gives the package one consistent C++ runtime; where nothing was wrong, it changes
    nothing."""
    if sys.platform == "linux":
        ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6", mode=os.RTLD_GLOBAL)
