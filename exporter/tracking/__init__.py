"""What a job recorded and where it goes: the job's record, MLflow runs and their server, and the
comparison of a sweep's jobs. Imports no MLflow here: a job with mlflow=off never loads it."""
