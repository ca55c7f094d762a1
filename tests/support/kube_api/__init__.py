"""A fake Kubernetes API server for tests: the REST subset meshca uses, over real HTTP.

Usage::

    with KubeApiServer() as server:
        server.add_service_account_token("tok", "default", "sa", audiences=["istio-ca"])
        api = kubernetes.client.CoreV1Api(server.api_client())

or out of process: ``python -m tests.support.kube_api --port 0 --port-file PATH``.
"""

from .errors import ApiError
from .faults import Fault, FaultPlan
from .recorder import RequestRecord
from .resources import (
    CONFIGMAPS,
    LEASES,
    NAMESPACES,
    PODS,
    SECRETS,
    SERVICEACCOUNTS,
    ResourceType,
)
from .server import KubeApiServer
from .tokens import POD_NAME_KEY, POD_UID_KEY, TokenInfo

__all__ = [
    "CONFIGMAPS",
    "LEASES",
    "NAMESPACES",
    "PODS",
    "POD_NAME_KEY",
    "POD_UID_KEY",
    "SECRETS",
    "SERVICEACCOUNTS",
    "ApiError",
    "Fault",
    "FaultPlan",
    "KubeApiServer",
    "RequestRecord",
    "ResourceType",
    "TokenInfo",
]
