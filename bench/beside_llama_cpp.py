"""A GGUF checkpoint run by llama.cpp beside the project's artifacts made from the same file, in
one process on the same CPU: their quality on text, then prefill and decode speed.

Quality: the rows of text quality is measured on (exporter/quantize/quality.py's: Python's
documentation, or `--text FILE`), each a session of its own as validation runs an artifact with
a KV cache (exporter/validate/text.py: half the row a prefill, then a token at a time), all
judged by the same code against the float model: the GGUF file's own weights dequantized by
transformers, run in float64 without a cache. Per contender: top-1 agreement, KL divergence
(nats), perplexity and its ratio to the float model's, and the bytes it ships (the GGUF file;
the artifact, with the .ptd beside a .pte).

Speed: prefill from position 0 at several lengths and a decode step at several cache fills,
timed as the job's benchmark stage times them (exporter/benchmark/decoding.py), llama.cpp and
the artifacts taking turns, at each of `--threads`.

llama.cpp runs through its Python binding, llama-cpp-python, which builds llama.cpp for the
machine it installs on (`pip install llama-cpp-python`; not a dependency of the project), as
runtimes/loaders/llama_cpp.py runs it: a context of `--slots` positions, called as an artifact
with a KV cache is. The artifacts are named as in bench/kv_decode.py (`NAME=PATH` or
`NAME=RUNTIME:PATH`), each with a cache of `--slots` slots.

    python bench/beside_llama_cpp.py --gguf smol.gguf ours=aoti:RUN/model.pt2 --slots 128
    python bench/beside_llama_cpp.py --gguf smol.gguf ours=RUN/model.pte --slots 128 \\
        --threads 1 2 --rounds 3 --text notes.txt

Each speed figure is the median over `--rounds` rounds of each round's median; `spread` is
llama.cpp's largest round median over its smallest; `llama.cpp vs NAME`: that artifact's median
over llama.cpp's (above 1: llama.cpp is faster).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from tabulate import tabulate

# bench is no package that the project installs: bench.kv_decode is imported from the root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kv_decode import COMPILE, loaded, parse_artifact, table, timed
from exporter.benchmark.decoding import decode_fills
from exporter.config import BenchmarkConfig
from exporter.quantize.quality import ROW_TOKENS, EvalText, eval_text
from exporter.validate import text
from runtimes import Loaded, data_file_beside, set_threads
from runtimes.loaders.llama_cpp import LlamaCpp

LLAMA_CPP = "llama.cpp"


def reference(gguf: Path, length: int, path: str | None) -> tuple[EvalText, list[torch.Tensor]]:
    """The rows of `length` tokens quality is measured on, and the float model's logits
    [n, vocab] on each: the GGUF file's weights dequantized by transformers, in float64."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    rows = eval_text(tokenizer, length, path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float64,
        quantization_config=transformers.GgufConfig(dequantize=True),
        attn_implementation="sdpa",
    ).eval()
    with torch.no_grad():
        return rows, [model(row.unsqueeze(0)).logits[0] for row in rows.rows]


def artifact_bytes(runtime: str, path: Path) -> int:
    """The artifact's size, with the data file its runtime loads beside it."""
    data = data_file_beside(path, "eager" if runtime == COMPILE else runtime)
    return path.stat().st_size + (data.stat().st_size if data else 0)


def quality_table(
    labels: Sequence[str], figures: Sequence[dict[str, Any]], sizes: Sequence[int]
) -> str:
    """One row per contender: its figures against the float model's and its size, also over
    the first one's (the GGUF file's)."""
    headers = [
        "",
        "positions",
        "top-1",
        "KLD mean",
        "KLD p99",
        "perplexity",
        "vs float",
        "MB",
        "vs GGUF",
    ]
    rows = [
        [
            label,
            str(measured["positions"]),
            f"{measured['top1']:.4f}",
            f"{measured['kld_mean']:.5f}",
            f"{measured['kld_p99']:.4f}",
            f"{measured['perplexity']:.3f}",
            f"{measured['perplexity_ratio']:.4f}",
            f"{size / 1e6:.1f}",
            f"{size / sizes[0]:.2f}",
        ]
        for label, measured, size in zip(labels, figures, sizes, strict=True)
    ]
    return tabulate(rows, headers=headers, disable_numparse=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, required=True, help="the checkpoint llama.cpp runs")
    parser.add_argument("artifacts", nargs="*", type=parse_artifact, metavar="NAME=PATH")
    parser.add_argument("--slots", type=int, required=True, help="the artifacts' cache length")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.0, help="per call, contender, round")
    parser.add_argument("--text", help="UTF-8 text to measure quality on (default: Python's docs)")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("llama_cpp") is None:
        print(
            "llama.cpp's Python binding is not installed: pip install llama-cpp-python",
            file=sys.stderr,
        )
        return 2
    if any(runtime in ("eager", COMPILE) for _, runtime, _ in args.artifacts):
        # As in bench/kv_decode.py: a program.pt2 of an executorch job calls ExecuTorch's LLM
        # ops, whose CPU kernels torch loads with their library.
        with contextlib.suppress(ModuleNotFoundError):
            from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401

    longest = args.slots - 1
    rows, float_logits = reference(args.gguf, min(ROW_TOKENS, args.slots), args.text)
    set_threads("llama_cpp", max(args.threads))
    llama = LlamaCpp(args.gguf, args.slots)
    artifacts = [(runtime, loaded(runtime, path, "cpu")) for _, runtime, path in args.artifacts]
    labels = [LLAMA_CPP, *(name for name, _, _ in args.artifacts)]
    contenders: list[Loaded] = [llama, *(instance for _, instance in artifacts)]
    sizes = [
        args.gguf.stat().st_size,
        *(artifact_bytes(runtime, path) for _, runtime, path in args.artifacts),
    ]
    figures = [
        text.measured(
            float_logits,
            text.run(lambda c=contender: c, {"rows": list(rows.rows)}, args.slots, longest),
            rows.rows,
        )
        for contender in contenders
    ]
    print(
        f"\nQuality on {rows.source}, against the GGUF file's weights dequantized in float64 "
        f"(perplexity {figures[0]['perplexity_float']:.3f}); llama.cpp by llama-cpp-python "
        f"{importlib.metadata.version('llama-cpp-python')}"
    )
    print(quality_table(labels, figures, sizes))

    lengths = sorted({1, (1 + longest) // 2 | 1, longest})
    fills = decode_fills(1, args.slots)
    tokens = torch.randint(
        0,
        float_logits[0].shape[-1],
        (args.slots,),
        generator=torch.Generator().manual_seed(0),
    )
    settings = BenchmarkConfig(enabled=True, repeats=1000, seconds=args.seconds, threads=None)
    calls = [("prefill", length) for length in lengths] + [("decode", fill) for fill in fills]
    for threads in args.threads:
        set_threads("llama_cpp", threads)
        for runtime, _ in artifacts:
            set_threads("eager" if runtime == COMPILE else runtime, threads)
        medians = timed(contenders, tokens, calls, longest, settings, args.rounds)
        print(f"\n{threads} thread{'s' if threads > 1 else ''}, {args.rounds} rounds")
        print(table(labels, calls, medians))
    return 0


if __name__ == "__main__":
    sys.exit(main())
