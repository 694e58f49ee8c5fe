"""`python tests/bare_target.py BLOCKED CHECK_ARGS...`: runs `python -m runtimes.check CHECK_ARGS`
as on a target that has none of the comma-separated BLOCKED packages: each is made unimportable
before the check starts (a None entry in sys.modules, Python's own way to refuse an import), so
the check fails if it, or anything it loads, imports one."""

from __future__ import annotations

import runpy
import sys

blocked, *check_args = sys.argv[1:]
for name in blocked.split(","):
    sys.modules[name] = None  # type: ignore[assignment]
sys.argv = ["runtimes.check", *check_args]
runpy.run_module("runtimes.check", run_name="__main__", alter_sys=True)
