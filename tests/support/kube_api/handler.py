"""HTTP routing and request handling for the Kubernetes REST subset.

Paths follow the real layout (``/api/v1/...``, ``/apis/{group}/{version}/...``) and responses use
the same status codes, ``kind: Status`` errors and chunked watch framing, because the official
client (and its ``watch.Watch``) is the contract being tested against.
"""

from __future__ import annotations

import base64
import contextlib
import json
import queue
import select
import socket
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

from tests.support.quiet_http import QuietThreadingHTTPServer

from . import errors
from .admin import ADMIN_PREFIX, handle_admin
from .backend import Backend
from .errors import ApiError
from .faults import Fault
from .issuer import DISCOVERY_PATH, JWKS_PATH
from .recorder import RequestRecord
from .resources import CLUSTERTRUSTBUNDLES, NAMESPACES, PODS, ResourceType
from .routes import TOKENREVIEW_PATH, Route, parse_route, verb_for
from .selectors import parse_field_selector, parse_label_selector
from .store import BOOKMARK, Watcher

_POLL_SECONDS = 0.2


def _strip_type(obj: dict[str, Any]) -> dict[str, Any]:
    """List items omit kind/apiVersion on the wire, as in the real API."""
    return {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}


def _success_status(rt: ResourceType, gone: dict[str, Any]) -> dict[str, Any]:
    """What most registries return from DELETE: a Success Status naming the object."""
    details: dict[str, Any] = {"name": gone["metadata"]["name"], "kind": rt.plural}
    if rt.group:
        details["group"] = rt.group
    details["uid"] = gone["metadata"]["uid"]
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "details": details,
    }


def _encode_continue(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    key = json.dumps([meta.get("namespace", ""), meta["name"]])
    return base64.urlsafe_b64encode(key.encode()).decode()


def _decode_continue(token: str) -> tuple[str, str]:
    try:
        namespace, name = json.loads(base64.urlsafe_b64decode(token.encode()))
        return str(namespace), str(name)
    except (ValueError, TypeError):
        raise errors.bad_request(f"invalid continue token {token!r}") from None


class KubeApiHTTPServer(QuietThreadingHTTPServer):
    """Threaded HTTP server that remembers open sockets so ``stop()`` can cut them."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], backend: Backend) -> None:
        self.backend = backend
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, KubeApiHandler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        with self._connections_lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class KubeApiHandler(BaseHTTPRequestHandler):
    """One connection; HTTP/1.1 keep-alive so the client's connection pool is exercised."""

    protocol_version = "HTTP/1.1"
    server_version = "meshca-fake-kube-apiserver"

    @property
    def backend(self) -> Backend:
        return cast(KubeApiHTTPServer, self.server).backend

    def log_message(self, format: str, *args: Any) -> None:
        """Silence per-request logging; the recorder keeps what tests need."""

    # -- plumbing ----------------------------------------------------------------------------

    def _send_json(self, code: int, obj: Any) -> None:
        body = json.dumps(obj, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if code == 429:
            self.send_header("Retry-After", "1")
        self.end_headers()
        self.wfile.write(body)

    def _send_text(self, code: int, text: str) -> None:
        body = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _read_body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length > 0 else b""
        if not raw:
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise errors.bad_request(f"invalid JSON body: {exc}") from None

    def _authorized(self) -> bool:
        expected = self.backend.auth_token
        return expected is None or self.headers.get("Authorization") == f"Bearer {expected}"

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # -- dispatch ----------------------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        record: RequestRecord | None = None
        try:
            body = self._read_body() if method in ("POST", "PUT", "PATCH", "DELETE") else None
            if url.path in ("/healthz", "/readyz", "/livez"):
                self._send_text(200, "ok")
                return
            if url.path.startswith(ADMIN_PREFIX):
                self._send_json(
                    *handle_admin(self.backend, method, url.path[len(ADMIN_PREFIX) :], body)
                )
                return
            if not self._authorized():
                raise ApiError(401, "Unauthorized", "Unauthorized")
            if url.path == "/version":
                self._send_json(200, {"major": "1", "minor": "31", "gitVersion": "v1.31.0-fake"})
                return
            if url.path in (DISCOVERY_PATH, JWKS_PATH):
                # Non-resource URLs: RBAC names them by path (nonResourceURLs), so do the records.
                record = self.backend.recorder.record(
                    RequestRecord(
                        method, url.path, "get", url.path, user_agent=self.headers.get("User-Agent")
                    )
                )
                if method != "GET":
                    raise ApiError(405, "MethodNotAllowed", "the server does not allow this method")
                self._apply_fault("get", url.path)  # armed as Fault("get", JWKS_PATH, ...)
                issuer = self.backend.issuer
                record.code = 200
                self._send_json(
                    200, issuer.discovery() if url.path == DISCOVERY_PATH else issuer.jwks()
                )
                return
            if url.path.rstrip("/") == TOKENREVIEW_PATH:
                record = self.backend.recorder.record(
                    RequestRecord(
                        method,
                        self.path,
                        "create",
                        "tokenreviews",
                        user_agent=self.headers.get("User-Agent"),
                    )
                )
                if method != "POST":
                    raise ApiError(405, "MethodNotAllowed", "the server does not allow this method")
                self._apply_fault("create", "tokenreviews")
                record.code = 201
                self._send_json(201, self.backend.tokens.review(body))
                return
            route = parse_route(url.path)
            verb = verb_for(method, route, query)
            resource = route.rt.plural + (f"/{route.subresource}" if route.subresource else "")
            record = self.backend.recorder.record(
                RequestRecord(
                    method,
                    self.path,
                    verb,
                    resource,
                    route.namespace,
                    route.name,
                    user_agent=self.headers.get("User-Agent"),
                )
            )
            if verb == "watch" and "sendInitialEvents" in query:
                # This server plays one without watch-list (the feature gate off, or older than
                # 1.27), as kube-apiserver answers then; clients list in pages instead. The
                # real API server's watch-list is exercised in tests/k8s_real.
                raise errors.invalid(
                    "ListOptions",
                    "",
                    "sendInitialEvents: Forbidden: sendInitialEvents is forbidden for watch "
                    "unless the WatchList feature gate is enabled",
                )
            fault = self._apply_fault(verb, resource)
            if route.rt is CLUSTERTRUSTBUNDLES and verb in ("create", "update"):
                self._attest(method, verb, route, body)
            if verb == "watch":
                record.code = 200
                self._watch(route, query, fault)
                return
            code, payload = self._handle(verb, route, query, body)
            record.code = code
            self._send_json(code, payload)
        except ApiError as exc:
            if record is not None:
                record.code = exc.code
            self._send_json(exc.code, exc.to_status())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:
            # A bug here must surface as a 500 Status (and a traceback), not a hung client.
            traceback.print_exc(file=sys.stderr)
            if record is not None:
                record.code = 500
            error = ApiError(500, "InternalError", f"fake kube-apiserver bug: {exc!r}")
            with contextlib.suppress(OSError):
                self._send_json(500, error.to_status())
            self.close_connection = True

    def _attest(self, method: str, verb: str, route: Route, body: Any) -> None:
        """What kube-apiserver checks of a ClusterTrustBundle write with a signer: the name's
        prefix, an unchanged signer, and (ClusterTrustBundleAttest admission) that the writer
        may `attest` for the signer — recorded as that authorization check, so the RBAC
        contract sees the verb; this server allows it."""
        spec = (body or {}).get("spec") or {} if isinstance(body, dict) else {}
        signer = spec.get("signerName") or ""
        name = ((body or {}).get("metadata") or {}).get("name", "")
        if not signer:
            return
        prefix = signer.replace("/", ":") + ":"
        if not name.startswith(prefix):
            raise errors.invalid(
                "ClusterTrustBundle",
                name,
                f"metadata.name: Invalid value: {name!r}: ClusterTrustBundle for signerName "
                f"{signer} must be named with prefix {prefix}",
            )
        if verb == "update" and route.name is not None:
            current = self.backend.store.get(CLUSTERTRUSTBUNDLES, None, route.name)
            if (current.get("spec") or {}).get("signerName", "") != signer:
                raise errors.invalid(
                    "ClusterTrustBundle", name, "spec.signerName: Invalid value: field is immutable"
                )
        self.backend.recorder.record(
            RequestRecord(
                method,
                self.path,
                "attest",
                "signers",
                None,
                signer,
                code=200,
                user_agent=self.headers.get("User-Agent"),
            )
        )

    def _apply_fault(self, verb: str, resource: str) -> Fault | None:
        """Delays and/or fails the request if a matching fault is armed (`faults.py`). A 410
        on a watch is delivered in the stream, as kube-apiserver does."""
        fault = self.backend.faults.take(verb, resource)
        if fault is None:
            return None
        if fault.delay:
            time.sleep(fault.delay)
        error = fault.error()
        if error is not None and not (verb == "watch" and error.code == 410):
            raise error
        return fault

    def _handle(self, verb: str, route: Route, query: dict[str, str], body: Any) -> tuple[int, Any]:
        store, rt = self.backend.store, route.rt
        keep_status = route.subresource is None and rt in (PODS, NAMESPACES)
        if verb in ("create", "update") and not isinstance(body, dict):
            raise errors.bad_request("request body must be a JSON object")
        if verb == "get":
            assert route.name is not None
            return 200, store.get(rt, route.namespace, route.name)
        if verb == "list":
            return 200, self._list(route, query)
        if verb == "create":
            return 201, store.create(rt, route.namespace, body)
        if verb == "update":
            assert route.name is not None
            return 200, store.update(
                rt,
                route.namespace,
                route.name,
                body,
                subresource=route.subresource,
                keep_status=keep_status,
            )
        if verb == "patch":
            assert route.name is not None
            content_type = self.headers.get("Content-Type") or ""
            return 200, store.patch(
                rt,
                route.namespace,
                route.name,
                content_type,
                body,
                subresource=route.subresource,
                keep_status=keep_status,
            )
        if verb == "delete":
            assert route.name is not None
            pre = (body or {}).get("preconditions") or {} if isinstance(body, dict) else {}
            gone = store.delete(
                rt,
                route.namespace,
                route.name,
                precondition_rv=pre.get("resourceVersion"),
                precondition_uid=pre.get("uid"),
            )
            if rt in (PODS, NAMESPACES):
                return 200, gone  # these registries return the deleted object
            return 200, _success_status(rt, gone)
        # deletecollection
        items, _ = store.list(rt, route.namespace, self._predicate(rt, query))
        deleted = []
        for item in items:
            meta = item["metadata"]
            try:
                deleted.append(store.delete(rt, meta.get("namespace"), meta["name"]))
            except ApiError:
                continue  # deleted concurrently
        _, rv = store.list(rt, route.namespace, lambda _obj: False)
        return 200, {
            "kind": rt.list_kind,
            "apiVersion": rt.api_version,
            "metadata": {"resourceVersion": str(rv)},
            "items": [_strip_type(item) for item in deleted],
        }

    @staticmethod
    def _predicate(rt: ResourceType, query: dict[str, str]) -> Any:
        labels = parse_label_selector(query.get("labelSelector"))
        fields = parse_field_selector(query.get("fieldSelector"), rt)
        return lambda obj: labels(obj) and fields(obj)

    def _list(self, route: Route, query: dict[str, str]) -> dict[str, Any]:
        if self.backend.list_delay > 0:
            self.backend.stopping.wait(self.backend.list_delay)
        rt = route.rt
        items, rv = self.backend.store.list(rt, route.namespace, self._predicate(rt, query))
        metadata: dict[str, Any] = {"resourceVersion": str(rv)}
        if token := query.get("continue"):
            after = _decode_continue(token)
            items = [
                i
                for i in items
                if (i["metadata"].get("namespace", ""), i["metadata"]["name"]) > after
            ]
        limit = int(query.get("limit") or 0)
        if 0 < limit < len(items):
            metadata["continue"] = _encode_continue(items[limit - 1])
            metadata["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        return {
            "kind": rt.list_kind,
            "apiVersion": rt.api_version,
            "metadata": metadata,
            "items": [_strip_type(item) for item in items],
        }

    # -- watch -------------------------------------------------------------------------------

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _write_event(self, type_: str, obj: dict[str, Any]) -> None:
        line = json.dumps({"type": type_, "object": obj}, separators=(",", ":")) + "\n"
        self._write_chunk(line.encode())

    def _client_gone(self) -> bool:
        """True if the peer closed its end (detected without consuming pipelined bytes)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _watch(self, route: Route, query: dict[str, str], fault: Fault | None = None) -> None:
        backend, rt = self.backend, route.rt
        predicate = self._predicate(rt, query)
        timeout = float(query.get("timeoutSeconds") or backend.watch_timeout)
        bookmarks = query.get("allowWatchBookmarks", "").lower() in ("true", "1")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache, private")
        self.end_headers()
        watcher: Watcher | None = None
        try:
            if fault is not None and fault.status == 410:
                self._write_event(
                    "ERROR",
                    ApiError(
                        410, "Expired", "too old resource version (injected fault)"
                    ).to_status(),
                )
                self.wfile.write(b"0\r\n\r\n")
                return
            try:
                watcher = backend.store.watch(
                    rt, route.namespace, predicate, query.get("resourceVersion")
                )
            except ApiError as exc:
                # Like kube-apiserver: a 200 stream carrying a single ERROR event (e.g. 410).
                self._write_event("ERROR", exc.to_status())
            else:
                limit = fault.drop_watch_after if fault is not None else None
                self._pump(watcher, rt, timeout, bookmarks, limit)
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.close_connection = True
        finally:
            if watcher is not None:
                backend.store.unwatch(watcher)

    def _pump(
        self,
        watcher: Watcher,
        rt: ResourceType,
        timeout: float,
        bookmarks: bool,
        drop_after: int | None = None,
    ) -> None:
        backend = self.backend
        deadline = time.monotonic() + timeout
        sent = 0
        while not backend.stopping.is_set():
            if drop_after is not None and sent >= drop_after:
                self.close_connection = True  # an injected fault: the stream just ends
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                item = watcher.queue.get(timeout=min(remaining, _POLL_SECONDS))
            except queue.Empty:
                if self._client_gone():
                    self.close_connection = True
                    return
                continue
            if item is None:
                return
            self._write_event(*item)
            sent += 1
        if bookmarks and not backend.stopping.is_set():
            # Drain under the store lock so the bookmark's version covers every sent event.
            with backend.store.locked():
                pending: list[tuple[str, dict[str, Any]]] = []
                while True:
                    try:
                        next_item = watcher.queue.get_nowait()
                    except queue.Empty:
                        break
                    if next_item is not None:
                        pending.append(next_item)
                rv = backend.store.resource_version
            for pending_item in pending:
                self._write_event(*pending_item)
            marker = {"kind": rt.kind, "apiVersion": rt.api_version}
            self._write_event(BOOKMARK, {**marker, "metadata": {"resourceVersion": str(rv)}})
