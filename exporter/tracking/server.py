"""Whether an MLflow tracking server answers, asked without loading MLflow: a URI nobody answers
at is a configuration error found in seconds, before a job's worker loads torch, rather than
after MLflow's own retries (about four minutes)."""

from __future__ import annotations

import urllib.error
import urllib.request

from exporter.errors import TrackingUnavailable

# How long a tracking server may take to answer before the job gives up on it.
PROBE_SECONDS = 3


def is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def probe(uri: str) -> None:
    """Raises TrackingUnavailable unless a server answers at `uri` within seconds. Any HTTP
    answer will do (a proxy may refuse /health); only silence or a refused connection fails."""
    try:
        urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=PROBE_SECONDS).close()
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise TrackingUnavailable(
            f"no MLflow tracking server answers at mlflow.tracking_uri={uri} ({reason}); start "
            "one (mlflow server --host ... --port ...) or point mlflow.tracking_uri at one that "
            "runs, or use mlflow=local or mlflow=off."
        ) from None
