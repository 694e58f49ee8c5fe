"""`python tests/bare_target.py BLOCKED MODULE ARGS...`: runs `python -m MODULE ARGS` (a command
of runtimes/: `runtimes.check`, `runtimes.run`) as on a target that has none of the
comma-separated BLOCKED packages: each is made unimportable before the command starts (a None
entry in sys.modules, Python's own way to refuse an import), so the command fails if it, or
anything it loads, imports one."""

from __future__ import annotations

import runpy
import sys

blocked, module, *args = sys.argv[1:]
for name in blocked.split(","):
    sys.modules[name] = None  # type: ignore[assignment]
sys.argv = [module, *args]
runpy.run_module(module, run_name="__main__", alter_sys=True)
