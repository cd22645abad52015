"""`prefect server start` (the arguments after this module's name) whose app answers only requests addressed to
127.0.0.1 or localhost (`alignflow ui` runs it). A web page whose host name its owner re-points at 127.0.0.1 (DNS
rebinding) is same-origin to the server: CORS lets it read the answers and fetch the CSRF token, and it read the
workspace's runs and created flows (a helper's requests). Prefect checks no Host header; MLflow's server does."""

from __future__ import annotations

import sys

from prefect.cli import app
from prefect.server.api import server
from starlette.middleware.trustedhost import TrustedHostMiddleware

LOCAL_HOSTS = ["127.0.0.1", "localhost"]
_prefect_create_app = server.create_app


def create_app(*args, **kwargs):
    """Prefect's app behind a check of the Host header: any other host is answered 400 `Invalid host header`."""
    prefect_app = _prefect_create_app(*args, **kwargs)
    prefect_app.add_middleware(TrustedHostMiddleware, allowed_hosts=LOCAL_HOSTS)
    return prefect_app


if __name__ == "__main__":
    server.create_app = create_app  # `prefect server start` imports it from there when it starts the server
    sys.argv[0] = "prefect"
    sys.exit(app())
