"""The entry points: `python -m exporter` (one job, or a sweep with -m), its help, and `track`,
which attaches a target's report to its job's MLflow run."""
