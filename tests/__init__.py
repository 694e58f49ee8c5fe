"""The tests. Their jobs in the test's own process (tests/conftest.py's job_in_process) wait for
torch's OpenMP threads as a job's worker does (exporter/job/worker.py): threads that spin while
they wait take the time slices of the other xdist worker on a 2-core machine. Set here, before
anything imports torch, whose OpenMP runtime reads it once as it loads; a setting of the user's
wins."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
