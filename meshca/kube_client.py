"""The one place that builds a `kubernetes.client.ApiClient`, for the CA and the node agent.

Credentials come from a kubeconfig file (its current context) or, without one, from the pod's
in-cluster service account. Each client gets a deliberate connection-pool size (long-lived
watches each hold a connection), one retry for a dropped connection, and a user agent naming the
program and replica, so API-server audit logs can tell them apart.
"""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes.client
import kubernetes.config
import yaml
from kubernetes.client.exceptions import ApiException

# Enough for RBAC's "User ... cannot list resource ... in API group ... at the cluster scope".
_MESSAGE_LIMIT = 300


class KubeCredentialsError(Exception):
    """The kubeconfig or in-cluster credentials cannot be loaded; the message says which."""


def build_api_client(
    kubeconfig: Path | None, *, pool_size: int, user_agent: str
) -> kubernetes.client.ApiClient:
    """An `ApiClient` for the cluster in `kubeconfig` (its current context), or in-cluster."""
    configuration = kubernetes.client.Configuration()
    try:
        if kubeconfig is None:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
        else:
            kubernetes.config.load_kube_config(
                config_file=str(kubeconfig),
                client_configuration=configuration,
                persist_config=False,
            )
    # A kubeconfig that is not YAML, or whose fields have the wrong types, fails inside the
    # client with a parser or type error: all of them are "this file is unusable".
    except (kubernetes.config.ConfigException, OSError, yaml.YAMLError, TypeError) as exc:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "in-cluster service account"
        raise KubeCredentialsError(
            f"cannot load Kubernetes credentials from the {where}: {exc}"
        ) from exc
    configuration.connection_pool_maxsize = pool_size
    configuration.retries = 1
    client = kubernetes.client.ApiClient(configuration)
    client.user_agent = user_agent
    return client


def api_error_text(exc: ApiException) -> str:
    """`HTTP 403 Forbidden: <the API server's message>`, for logs and error messages.

    The status line alone does not say what to fix; the server's `Status.message` does — for a
    refusal by RBAC it names the user, verb, resource, API group and scope, i.e. the missing
    permission. Cut to one short line: the body is the server's, not ours."""
    text = f"HTTP {exc.status} {exc.reason}"
    message = _status_message(exc.body)
    return f"{text}: {message}" if message else text


def _status_message(body: object) -> str | None:
    if isinstance(body, bytes):
        body = body.decode("utf-8", errors="replace")
    if not isinstance(body, str) or not body:
        return None
    try:
        status = json.loads(body)
    except ValueError:
        return None
    message = status.get("message") if isinstance(status, dict) else None
    if not isinstance(message, str) or not message:
        return None
    return " ".join(message.split())[:_MESSAGE_LIMIT]
