"""KV-cache artifacts side by side on one checkpoint: prefill at several lengths from position 0
and a decode step (ms per token) at several cache fills, in one process, timed as the job's
benchmark stage times them (exporter/benchmark/decoding.py: each instance's cache is filled to
the position by a session of the same tokens, then the step is timed repeatedly, rewriting its
slot), the artifacts taking turns.

Any artifact with the signature `forward(input_ids[1, S], cache_position[S]) -> logits` and its
cache in mutable buffers: ours (model.pte of `python -m exporter model.kv_cache=static`, with
ExecuTorch's LLM ops or `backend.llm_ops=plain`), a
peer's .pte (optimum-executorch's `optimum-cli export executorch --recipe xnnpack`, installed
apart from the project: ExecuTorch's LLM ops are registered by the loader where the program
calls them), or a program.pt2 run in eager PyTorch (the job's eager beside the artifact).
`NAME=RUNTIME:PATH` names the runtime where the suffix does not: `aoti:RUN/model.pt2` (an
AOTInductor package), and `compile:RUN/program.pt2`, the exported program's module under
`torch.compile(mode="reduce-overhead")`, what a user would pick instead of exporting.

    python bench/kv_decode.py ours=RUN/model.pte peer=OPTEX/model.pte eager=RUN/program.pt2 \\
        --slots 128 --threads 1 2 --rounds 3
    python bench/kv_decode.py ours=aoti:RUN/model.pt2 compiled=compile:RUN/program.pt2 \\
        eager=RUN/program.pt2 --slots 1024 --max-prefill 128 --device cuda
    python bench/kv_decode.py ... --slots 2048 --max-prefill 1 --prefills 128 1024

`--prefills` times prompts of other lengths than the cache is filled with (each within the
program's seq bound: export with `dynamic.seq.max` at least the longest).

Each figure is the median over `--rounds` rounds of each round's median; `spread` is the
largest round median over the smallest, of the first artifact. `vs NAME`: that artifact's
median over this one's (above 1: this one is faster).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from tabulate import tabulate
from torch.export.passes import move_to_device_pass

from exporter.benchmark.decoding import decode_fills, time_decode, time_prefill
from exporter.config import BenchmarkConfig
from runtimes import Loaded, load, names, set_threads
from runtimes.on_device import OnDevice

# The runtime that runs a file, by its suffix, where NAME=RUNTIME:PATH names none.
RUNTIMES = {".pte": "executorch", ".pt2": "eager"}
COMPILE = "compile"


def parse_artifact(value: str) -> tuple[str, str, Path]:
    """NAME=PATH or NAME=RUNTIME:PATH -> (name, runtime, path)."""
    name, sep, rest = value.partition("=")
    runtime, colon, path = rest.partition(":")
    if not colon:
        runtime, path = RUNTIMES.get(Path(rest).suffix, ""), rest
    if not sep or runtime not in (*names(), COMPILE):
        raise argparse.ArgumentTypeError(
            f"{value!r}: give NAME=PATH with a .pte (ExecuTorch) or a .pt2 (eager PyTorch), or "
            f"NAME=RUNTIME:PATH with RUNTIME one of {', '.join((*names(), COMPILE))}"
        )
    return name, runtime, Path(path)


def loaded(runtime: str, path: Path, device: str) -> Loaded:
    if runtime != COMPILE:
        return load(path, runtime, device)
    on = torch.device(device)
    if on.type == "cuda" and on.index is None:
        # The program's device checks compare the device's full name.
        on = torch.device("cuda", torch.cuda.current_device())
    # The program's own constants (an arange's device) move with it, as the eager loader does.
    module = move_to_device_pass(torch.export.load(path), on).module()
    return OnDevice(torch.compile(module, mode="reduce-overhead"), on)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+", type=parse_artifact, metavar="NAME=PATH")
    parser.add_argument("--slots", type=int, required=True, help="the cache's length")
    parser.add_argument(
        "--max-prefill", type=int, help="the longest prefill all take (default: slots - 1)"
    )
    parser.add_argument(
        "--prefills",
        type=int,
        nargs="+",
        help="the prompt lengths timed (default: 1, the middle and --max-prefill); the cache "
        "is filled before decode steps by prefills of at most --max-prefill tokens",
    )
    parser.add_argument("--vocab", type=int, default=512, help="token ids drawn below it")
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.0, help="per call, artifact, round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="where the artifacts run: cpu or cuda")
    args = parser.parse_args(argv)
    longest = args.max_prefill or args.slots - 1
    lengths = sorted(set(args.prefills or (1, (1 + longest) // 2 | 1, longest)))
    if lengths[0] < 1 or lengths[-1] >= args.slots:
        parser.error(f"--prefills: lengths from 1 to {args.slots - 1} (the cache's slots - 1)")
    fills = decode_fills(1, args.slots)
    tokens = torch.randint(0, args.vocab, (args.slots,), generator=torch.Generator().manual_seed(0))
    labels = [name for name, _, _ in args.artifacts]
    if any(runtime in ("eager", COMPILE) for _, runtime, _ in args.artifacts):
        # A program.pt2 of an executorch job calls ExecuTorch's LLM ops
        # (backend.llm_ops=custom), whose CPU kernels torch loads with their library; a
        # machine without ExecuTorch (the GPU machine) times programs without them.
        with contextlib.suppress(ModuleNotFoundError):
            from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401

    instances = [
        (runtime, loaded(runtime, path, args.device)) for _, runtime, path in args.artifacts
    ]
    settings = BenchmarkConfig(
        enabled=True, warmup=args.warmup, repeats=1000, seconds=args.seconds, threads=None
    )
    calls = [("prefill", length) for length in lengths] + [("decode", fill) for fill in fills]
    for threads in args.threads:
        for runtime, _ in instances:
            set_threads("eager" if runtime == COMPILE else runtime, threads)
        contenders = [instance for _, instance in instances]
        medians = timed(contenders, tokens, calls, longest, settings, args.rounds)
        print(f"\n{threads} thread{'s' if threads > 1 else ''}, {args.rounds} rounds")
        print(table(labels, calls, medians))
    return 0


def timed(
    contenders: Sequence[Loaded],
    tokens: torch.Tensor,
    calls: Sequence[tuple[str, int]],
    longest: int,
    settings: BenchmarkConfig,
    rounds: int,
) -> dict[tuple[str, int], list[list[float]]]:
    """Each call's median ms per contender, per round, the contenders taking turns: a
    ("prefill", length) from position 0, or a ("decode", fill) step (prefills of at most
    `longest` tokens fill the caches)."""
    medians: dict[tuple[str, int], list[list[float]]] = {call: [] for call in calls}
    for _ in range(rounds):
        for kind, at in calls:
            timings = (
                time_prefill(contenders, tokens, at, settings)
                if kind == "prefill"
                else time_decode(contenders, tokens, at, longest, settings)
            )
            medians[(kind, at)].append([t.median_ms for t in timings])
    return medians


def table(
    labels: Sequence[str],
    calls: Sequence[tuple[str, int]],
    medians: dict[tuple[str, int], list[list[float]]],
) -> str:
    """One row per call: each artifact's median ms and tokens/s, the first one's spread over
    rounds, and every other's median over the first one's."""
    headers = ["call"]
    for name in labels:
        headers += [f"{name} ms", f"{name} tok/s"]
    headers += ["spread", *(f"{labels[0]} vs {name}" for name in labels[1:])]
    rows = []
    for kind, at in calls:
        rounds = medians[(kind, at)]
        per_artifact = [statistics.median(r[i] for r in rounds) for i in range(len(labels))]
        count = at if kind == "prefill" else 1
        row: list[str] = [f"prefill seq={at}" if kind == "prefill" else f"decode pos={at}"]
        for ms in per_artifact:
            row += [f"{ms:.3f}", f"{count * 1e3 / ms:.0f}"]
        first = [r[0] for r in rounds]
        row.append(f"{max(first) / min(first):.2f}")
        row += [f"{other / per_artifact[0]:.2f}x" for other in per_artifact[1:]]
        rows.append(row)
    return tabulate(rows, headers=headers, disable_numparse=True)


if __name__ == "__main__":
    sys.exit(main())
