"""What the HTTP limits take from uvicorn beyond its documented API (`uvicorn.Config`, `uvicorn.Server`).

`serving.http_limits` subclasses uvicorn's httptools protocol; nothing else imports uvicorn's internals. An upgrade
of uvicorn that changes anything listed here breaks the HTTP limits first, and here. Tested with uvicorn 0.30.0 and
0.55.0, the bounds in pyproject.toml; `make newest-deps` (CI, after `make test`) runs the HTTP-limits tests against
the newest release and says when it breaks them.

It relies on:

- `uvicorn.protocols.http.httptools_impl.HttpToolsProtocol`, subclassed: its constructor
  `(config, server_state, app_state, _loop)`; the attributes `loop`, `transport`, `flow`, `parser`, `scope`,
  `cycle`, `pipeline`, `expect_100_continue`, `client`, `logger` and `server_state.default_headers`; the parser
  callbacks `on_message_begin`, `on_url`, `on_header`, `on_headers_complete`, `on_body`, `on_message_complete`
  and `on_response_complete`, each extended and called; `data_received`, replaced whole (uvicorn's feeds the
  parser and answers its errors as the subclass does); `send_400_response` and `handle_websocket_upgrade`; and the
  private methods `_unset_keepalive_if_required` and `_should_upgrade` (`stop_keep_alive`, `upgrades`).
- `httptools_impl.RequestResponseCycle`, a request's `cycle`: `scope`, `response_started`, `response_complete`,
  and the private pair `disconnected` / `message_event` that uvicorn's `connection_lost` sets to end a request
  (`end_request`, `disconnected`).
- `httptools_impl.STATUS_LINE`, a status line per code.
- `uvicorn.protocols.http.flow_control.FlowControl`, subclassed: `read_paused`, `pause_reading`,
  `resume_reading`; and `HIGH_WATER_LIMIT`, the unread body at which uvicorn pauses reading.
- `uvicorn.server.ServerState`, the type of the protocol's `server_state`.

Of uvicorn's public classes, `serving.server` also relies on `uvicorn.Config(http=...)` taking a protocol class and
on uvicorn's signal handling calling `uvicorn.Server.handle_exit` (overridden by `DrainingServer`), and `serving.cli`
reads `uvicorn.Server.started`.
"""

from __future__ import annotations

from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

__all__ = [
    "HIGH_WATER_LIMIT",
    "STATUS_LINE",
    "FlowControl",
    "HttpToolsProtocol",
    "RequestResponseCycle",
    "ServerState",
    "disconnected",
    "end_request",
    "stop_keep_alive",
    "upgrades",
]


def stop_keep_alive(protocol: HttpToolsProtocol) -> None:
    """Cancel the idle connection's keep-alive timeout, as uvicorn does when data arrives."""
    protocol._unset_keepalive_if_required()


def upgrades(protocol: HttpToolsProtocol) -> bool:
    """Whether uvicorn hands the request being parsed to its websocket protocol (never with `ws="none"`)."""
    return protocol._should_upgrade()


def end_request(cycle: RequestResponseCycle) -> None:
    """The app's pending or next `receive()` returns `http.disconnect` and what it sends is dropped: what uvicorn
    does to the running request when its connection is lost."""
    cycle.disconnected = True
    cycle.message_event.set()


def disconnected(cycle: RequestResponseCycle) -> bool:
    """Whether the request's `receive()` returns `http.disconnect` (its connection lost, or `end_request`)."""
    return cycle.disconnected
