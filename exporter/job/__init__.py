"""A job's frame: the worker process it runs in, the pipeline that runs its stages in order,
where it writes, and how it ends (its summary, its MLflow run's close, its closing lines)."""
