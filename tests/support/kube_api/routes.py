"""URL layout of the Kubernetes REST API: which path means which resource and verb."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

from .errors import ApiError
from .resources import NAMESPACES, PODS, ResourceType, lookup

TOKENREVIEW_PATH = "/apis/authentication.k8s.io/v1/tokenreviews"


@dataclass
class Route:
    """A parsed resource URL."""

    rt: ResourceType
    namespace: str | None
    name: str | None
    subresource: str | None


def parse_route(path: str) -> Route:
    """Map a URL path to (type, namespace, name, subresource) or raise a 404 Status."""
    not_found = ApiError(404, "NotFound", "the server could not find the requested resource")
    segments = [unquote(s) for s in path.split("/") if s]  # a name may hold %3A (':')
    if segments[:2] == ["api", "v1"]:
        group, version, rest = "", "v1", segments[2:]
    elif len(segments) >= 3 and segments[0] == "apis":
        group, version, rest = segments[1], segments[2], segments[3:]
    else:
        raise not_found
    namespace: str | None = None
    if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] not in ("status", "finalize"):
        namespace, rest = rest[1], rest[2:]
    if not rest or len(rest) > 3:
        raise not_found
    rt = lookup(group, version, rest[0])
    if rt is None or (namespace is not None and not rt.namespaced):
        raise not_found
    name = rest[1] if len(rest) > 1 else None
    subresource = rest[2] if len(rest) > 2 else None
    if rt.namespaced and namespace is None and name is not None:
        raise not_found
    if subresource is not None and (subresource != "status" or rt not in (PODS, NAMESPACES)):
        raise not_found
    return Route(rt, namespace, name, subresource)


def verb_for(method: str, route: Route, query: dict[str, str]) -> str:
    """The Kubernetes verb (as in RBAC/audit) for a request; names the request counters."""
    watching = query.get("watch", "").lower() in ("true", "1")
    if method == "GET":
        if route.name is not None:
            return "get"
        return "watch" if watching else "list"
    if method == "POST" and route.name is None:
        return "create"
    if method == "PUT" and route.name is not None:
        return "update"
    if method == "PATCH" and route.name is not None:
        return "patch"
    if method == "DELETE":
        return "delete" if route.name is not None else "deletecollection"
    raise ApiError(405, "MethodNotAllowed", "the server does not allow this method")
