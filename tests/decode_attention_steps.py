"""Decode steps of an exported KV-cache program, as exporter/backends/aoti.py makes its decode
step, with and without the decode-attention rewrite (exporter/backends/common/decode_attention.py),
from the same cache contents; printed as JSON. It runs the kernel wherever Triton can: on the CPU
under Triton's interpreter, which it must be started with (TRITON_INTERPRET=1 is read when the
kernel is defined):

    TRITON_INTERPRET=1 python -m tests.decode_attention_steps PROGRAM.pt2 0 1 300 511

Each position is one step of one token; the caches hold seeded random keys and values before
the first, so that a step at a late position attends over a full cache without filling it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from exporter.backends import aoti
from exporter.backends.common import decode_attention


def steps(program_file: Path, positions: list[int]) -> dict:
    one_token = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    # Each loaded apart: a program's modules share its buffers, the caches among them.
    plain = aoti.decode_step_program(torch.export.load(program_file), one_token)
    rewritten = aoti.decode_step_program(torch.export.load(program_file), one_token)
    made = decode_attention.rewritten(rewritten)
    modules = plain.module(), rewritten.module()
    generator = torch.Generator().manual_seed(0)
    for name, cache in modules[0].named_buffers():
        if "cache" in name and cache.is_floating_point():
            cache.copy_(torch.randn(cache.shape, generator=generator).to(cache.dtype))
            dict(modules[1].named_buffers())[name].copy_(cache)
    tokens = torch.randint(0, 500, (len(positions),), generator=generator)
    worst, agree = 0.0, 0
    for token, pos in zip(tokens, positions, strict=True):
        inputs = (token.view(1, 1), torch.tensor([pos]))
        expected, got = (module(*inputs).float() for module in modules)
        worst = max(worst, ((got - expected).abs().max() / expected.abs().max()).item())
        agree += int(got.argmax() == expected.argmax())
    caches = {
        name: (buffer.float() - dict(modules[0].named_buffers())[name].float()).abs().max().item()
        for name, buffer in modules[1].named_buffers()
        if "cache" in name
    }
    calls = [node for node in rewritten.graph.nodes if node.op == "call_function"]
    attentions = [
        node for node in calls if node.target is torch.ops.exporter.decode_attention.default
    ]
    return {
        "rewritten": made,
        "targets": sorted({str(node.target) for node in calls}),
        # What each attention reads its tensors from, caches aside: a view or a computation
        # there is a kernel that Inductor launches for it in every layer.
        "attention_inputs": [
            [str(arg.target) for arg in node.args[:5] + node.args[7:9]] for node in attentions
        ],
        "worst": worst,
        "argmax_agree": agree,
        "cache_max_diff": max(caches.values()),
    }


if __name__ == "__main__":
    print(json.dumps(steps(Path(sys.argv[1]), [int(p) for p in sys.argv[2:]])))
