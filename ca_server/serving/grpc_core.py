"""grpcio's private Cython core (`grpc._cython.cygrpc`), imported and feature-detected here only.

Why one module: the completion-queue server (`ca_server.serving.cq_server`, its calls in
`ca_server.serving.cq_calls`) drives this private layer directly. It is decided per run, not
pinned: `completion_queue_problem` says whether the installed grpcio is a release the server
was tested with (`TESTED_GRPCIO`) and has every private name it uses (`REQUIRED_NAMES`);
`ca_server.serving.cq_server.rpc_server_for` falls back to `grpc.aio` (or refuses an explicit
`--rpc-server completion-queue`) when it does not. `cygrpc` is None where grpcio has no Cython
core at all.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

# grpcio releases the completion-queue server was tested with (pyproject.toml asks for the
# first at least, and sets no upper bound).
TESTED_GRPCIO = ("1.85.",)

try:  # the layer both of grpcio's servers are built on
    from grpc._cython import cygrpc
except ImportError:  # pragma: no cover - grpcio without its Cython core
    cygrpc = None

NO_FLAGS = 0
"""The flags of every batch operation the server starts (none)."""

REQUIRED_NAMES = (
    "Server",
    "CompletionQueue",
    "CompletionType",
    "ReceiveMessageOperation",
    "SendInitialMetadataOperation",
    "SendMessageOperation",
    "SendStatusFromServerOperation",
    "ReceiveCloseOnServerOperation",
    "auth_context",
)


def completion_queue_problem(core: Any = cygrpc, version: str = grpc.__version__) -> str | None:
    """Why this server cannot run with the installed grpcio, or None when it can. `core` and
    `version` are the installed `grpc._cython.cygrpc` and grpcio's version unless a test hands
    in others."""
    if core is None:
        return "grpc._cython.cygrpc is not importable"
    if not version.startswith(TESTED_GRPCIO):
        return f"grpcio {version} is not a tested release ({', '.join(TESTED_GRPCIO)}x)"
    missing = [name for name in REQUIRED_NAMES if not hasattr(core, name)]
    if missing:
        return f"grpc._cython.cygrpc lacks {', '.join(missing)}"
    if not hasattr(asyncio.events, "_set_running_loop"):
        return "asyncio.events._set_running_loop is missing"
    return None
