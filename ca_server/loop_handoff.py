"""`await to_the_loop()`: the rule every request handler obeys before it touches the event loop.

The CA's completion-queue server (`ca_server.serving.cq_server`) runs a handler's first step
inline on its own thread (`meshca-rpc-cq`), with the CA's loop registered as that thread's
running loop. The loop's own methods are not thread-safe: creating a task, a timer
(`asyncio.sleep`, `wait_for`, `asyncio.wait(timeout=...)`) or a future's callback from that
thread appends to the loop's ready queue or pushes onto its timer heap from outside the loop (a
heap the loop thread may be popping at that moment), and what it scheduled waits until something
else wakes the loop from `select`; asyncio's debug mode refuses it ("Non-thread-safe operation
invoked on an event loop other than the current one").

So a handler about to start I/O first awaits `to_the_loop()`: on the completion-queue thread it
suspends with nothing to wait for (a bare yield), the server hands the handler to the loop, and
the loop runs the rest (one hop, the one a handler that waits pays anyway); on the loop (a
resumed handler, or `--rpc-server aio`) it returns at once. The steady state (a cached or
development token, a client certificate) never gets there, so it stays on the completion-queue
thread. The CA's handlers do it where a token is new: `ca_server.kube.tokenreview` (before the
review), `ca_server.jwt_authn` (before reading a JWKS), `ca_server.kube.issuer_keys` (before
starting or joining a refresh); tests/k8s/test_loop_thread_safety.py runs a CA in debug mode
through those paths. `asyncio.current_task()` on the completion-queue thread names whatever
task the loop is running, so `asyncio.timeout()` and task groups also belong after
`to_the_loop()`.

A module of its own, beside the request path rather than in the server, so the code that obeys
the rule does not import the server that needs it.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Generator

_inline = threading.local()  # `.step` is True on a thread that runs handlers' first steps


def mark_inline_thread(inline: bool = True) -> None:
    """Says that the calling thread runs handlers' first steps outside the loop (the
    completion-queue server's polling thread), so `to_the_loop()` there hands them over."""
    _inline.step = inline


class _ToTheLoop:
    """What `to_the_loop()` returns: suspends once on an inline thread, with nothing to wait
    for (a bare yield), so the server hands the handler to the loop."""

    __slots__ = ()

    def __await__(self) -> Generator[None, None, None]:
        if getattr(_inline, "step", False):
            yield None


_TO_THE_LOOP = _ToTheLoop()


def to_the_loop() -> Awaitable[None]:
    """`await to_the_loop()` before a handler touches the event loop (a task, a timer, a
    future callback): on the completion-queue thread the rest of the handler then runs on the
    CA's loop; on the loop it returns at once (module docstring)."""
    return _TO_THE_LOOP
