"""Why a signal stopped a job, for its record: Ctrl-C, or for SIGTERM, Slurm's reason.

Slurm sends SIGTERM to every process of a job at its time limit, on `scancel` and on preemption
(SIGKILL follows after the cluster's KillWait). The signal alone does not say which; squeue
still lists the job while it ends, with its reason: `TimeLimit` at the time limit. Before
that, submitit asks Slurm for SIGUSR2 `signal_delay_s` before the limit (`sbatch
--signal=USR2@...`), to requeue a job that can resume from a checkpoint; a job of this tool
cannot, so it runs on until the limit.
"""

from __future__ import annotations

import os
import signal
import subprocess

# submitit's warning that the time limit is near (SlurmJobEnvironment.USR_SIG).
TIME_LIMIT_WARNING = signal.SIGUSR2


def job_id() -> str | None:
    """The Slurm job this process runs in, if any."""
    return os.environ.get("SLURM_JOB_ID")


def stop_reason(signum: int) -> str:
    """What stopped the job, in words: the time limit where Slurm says so."""
    name = signal.Signals(signum).name
    if signum == signal.SIGINT:
        return f"stopped by Ctrl-C ({name})"
    job = job_id()
    if job is None or signum != signal.SIGTERM:
        return f"stopped by {name}"
    reason = _squeue_reason(job)
    if reason == "TimeLimit":
        return (
            f"stopped by Slurm at its time limit (job {job}); "
            "give it more time with hydra.launcher.timeout_min"
        )
    said = f", squeue's reason: {reason}" if reason and reason != "None" else ""
    return f"stopped by Slurm (job {job}: scancel, preemption or a node's failure{said})"


def _squeue_reason(job: str) -> str | None:
    try:
        listed = subprocess.run(
            ["squeue", "--noheader", f"--jobs={job}", "--format=%r"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if listed.returncode != 0:
        return None
    return listed.stdout.strip() or None
