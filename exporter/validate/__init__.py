"""The validation stage: run the artifact at every planned live shape against the goldens, in
the order and under the rule of runtimes/verdict/ (which a target's check shares), with a log
line per execution and a progress bar on a terminal."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from collections.abc import Callable, Iterator, Sequence

import torch
from tokenizers import Tokenizer
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from exporter.errors import RuntimeFailed
from exporter.process import interrupts, memory
from runtimes import Loaded
from runtimes.verdict import judging
from runtimes.verdict import sessions as session_verdict
from runtimes.verdict.errors import ArtifactFailed
from runtimes.verdict.goldens import Goldens
from runtimes.verdict.judging import judge
from runtimes.verdict.report import Execution, Generation, Report, execution_line
from runtimes.verdict.shapes import LiveShape, executions, label
from runtimes.verdict.stats import Tolerances

log = logging.getLogger(__name__)

__all__ = ["Report", "Tolerances", "judge", "run"]


def run(
    output_names: Sequence[str],
    load: Callable[[], Loaded],
    shapes: Sequence[LiveShape],
    goldens: Goldens,
    tolerances: Tolerances,
    observe: Callable[[str, Sequence[torch.Tensor]], None] = lambda key, outputs: None,
) -> Report:
    """The artifact judged at every planned shape (or KV-cache session step); `observe(label,
    outputs)` is handed its outputs at each."""
    if goldens.sessions:
        return _sessions(output_names, load, shapes, goldens, tolerances, observe)
    order = executions(shapes)
    log.info(
        "[validate] %d live shapes (%s), %d executions, %s",
        len(shapes),
        ", ".join(label(s) for s in shapes),
        len(order),
        tolerances.describe(),
    )

    def load_alone() -> Loaded:
        # What the instance before this one held is handed back first: a 1B model's artifact
        # is never loaded twice.
        memory.release_freed()
        return load()

    with _progress(len(order), "run") as after_each:
        return judging.run(
            output_names, load_alone, shapes, order, goldens, tolerances, after_each, observe
        )


@contextlib.contextmanager
def _progress(total: int, unit: str) -> Iterator[Callable[[int, Execution], None]]:
    """What validation does after each of `total` executions (a log line, a tick of the bar, a
    Ctrl-C safe point), and the artifact's failure raised as the runtime's error."""
    # The bar shows on a terminal only (disable=None); the log lines say the same everywhere.
    # On stdout, beside the log: the job's stderr goes to native.log (runtimes/native_log.py).
    bar = tqdm(total=total, desc="validate", unit=unit, disable=None, file=sys.stdout)

    def after_each(number: int, execution: Execution) -> None:
        log.info("[validate] %s", execution_line(number, total, execution))
        bar.update()
        interrupts.check()

    with logging_redirect_tqdm(), bar:
        try:
            yield after_each
        except ArtifactFailed as error:
            raise RuntimeFailed(str(error)) from error


def _sessions(
    output_names: Sequence[str],
    load: Callable[[], Loaded],
    shapes: Sequence[LiveShape],
    goldens: Goldens,
    tolerances: Tolerances,
    observe: Callable[[str, Sequence[torch.Tensor]], None],
) -> Report:
    """A model with a KV cache: its sessions on one loaded instance, every step run and the
    sampled ones judged, then the greedy generation (runtimes/verdict/sessions.py)."""
    log.info(
        "[validate] %d sessions of prefill and decode to the cache's last slot (prefills %s), "
        "%d steps judged, %s",
        len(goldens.sessions),
        ", ".join(str(s["prefill"]) for s in goldens.sessions),
        len(shapes),
        tolerances.describe(),
    )

    def judged(outputs: Sequence[torch.Tensor], shape: LiveShape) -> tuple:
        observe(label(shape), outputs)
        return judge(output_names, outputs, shape, goldens, tolerances)

    with _progress(len(shapes), "step") as after_each:
        report = session_verdict.run(output_names, load, goldens, tolerances, judged, after_each)
    if report.generation is None:
        return report
    log.info("[validate] %s", report.generation.line())
    if goldens.greedy is not None and "tokenizer" in goldens.greedy:
        report = dataclasses.replace(report, generation=_read(report.generation, goldens.greedy))
        for who, text in report.generation.text.items():
            log.info("[validate] %s: %r", who, text)
    return report


def _read(generation: Generation, greedy: dict) -> Generation:
    """`generation` with its prompt and each generation decoded by the checkpoint's tokenizer
    that the goldens kept."""
    tokenizer = Tokenizer.from_str(greedy["tokenizer"])
    text = {"prompt": greedy["prompt_text"]}
    for who in ("artifact", "eager", "oracle"):
        text[who] = tokenizer.decode(getattr(generation, who), skip_special_tokens=False)
    return dataclasses.replace(generation, text=text)
