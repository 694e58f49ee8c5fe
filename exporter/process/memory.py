"""Peak resident memory (RSS) of the job's worker process, per stage and for the whole job.

On Linux a stage starts by resetting the process's high-water mark (writing "5" to
/proc/self/clear_refs) and ends by reading it (VmHWM in /proc/self/status): the stage's own peak.
Elsewhere, or where the kernel refuses the reset, the figure is getrusage's ru_maxrss, the
process's peak since it started: a stage's figure is then the job's peak so far, not its own, and
`scope()` says "process" instead of "stage".

What is measured is the worker's resident set in host memory. For backend.device=cuda the
tensors on the GPU are not in it (only the host's copies and the CUDA runtime's own memory are),
nor is the memory of child processes (the compiler AOTInductor runs). Imports no torch: the
command's process, which stays small, imports this through the job's record.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import re
import resource
import sys
from pathlib import Path

log = logging.getLogger(__name__)

GB = 1e9

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_HWM = re.compile(r"^VmHWM:\s+(\d+) kB$", re.MULTILINE)
_RSS = re.compile(r"^VmRSS:\s+(\d+) kB$", re.MULTILINE)
# Whether the high-water mark can be reset; None until the first reset tries.
_resettable: bool | None = None


def reset_peak() -> int:
    """The peak RSS in bytes since the last reset (or the process's start), then resets it where
    this system can: what follows is measured from the current RSS up."""
    global _resettable
    peak = peak_rss()
    if _resettable is not False:
        try:
            _CLEAR_REFS.write_text("5")
            _resettable = True
        except OSError as error:
            _resettable = False
            log.info(
                "cannot reset the peak RSS (%s); each stage's peak RSS is the process's since it "
                "started",
                error,
            )
    return peak


def peak_rss() -> int:
    """The peak RSS in bytes since the last reset: VmHWM where the reset works, else the
    process's peak since it started (ru_maxrss)."""
    if _resettable:
        match = _HWM.search(_STATUS.read_text())
        if match:
            return int(match.group(1)) * 1024
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Bytes on macOS, KiB on Linux and the BSDs.
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def resident() -> int:
    """The process's resident memory (RSS) now, in bytes: VmRSS where /proc says, else its peak
    so far (ru_maxrss)."""
    match = _RSS.search(_STATUS.read_text()) if _STATUS.exists() else None
    return int(match.group(1)) * 1024 if match else peak_rss()


def scope() -> str:
    """What a stage's peak covers: "stage" (its own) or "process" (the process's so far)."""
    return "stage" if _resettable else "process"


def release_freed() -> None:
    """Frees what nothing references any more and hands the freed heap back to the system.

    An nn.Module's reference cycles keep its weights until a collection; and tensors under
    glibc's mmap threshold (32 MB: a 2048x2048 float32 projection) come from the heap, which
    keeps freed memory resident until trimmed, so the next stage would start from the old peak."""
    gc.collect()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def collect_less_often() -> None:
    """Python's collector runs every 700 new container objects, and walks everything alive at
    every tenth of its second-generation runs; lowering allocates millions (fx graphs, fake
    tensors), so with the defaults a tiny Llama's job spent 11 of its seconds collecting. Every
    5000 and every tenth: cycles of garbage wait a few milliseconds longer. For the job's worker
    process, which ends with its job."""
    gc.set_threshold(5000, 10, 10)


def spare_survivors() -> None:
    """Moves every object alive now out of reach of Python's garbage collector for the rest of
    the process (gc.freeze): its collections stop walking them.

    Torch, transformers and MLflow import millions of objects that live as long as the process,
    which every full collection walked again. Only for the job's worker process, which ends
    with its job, and only where what is alive lives on (after `release_freed`): an object
    spared here that later becomes garbage in a reference cycle stays until the process ends."""
    gc.freeze()
