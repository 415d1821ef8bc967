"""The admission routes: read the (capped) body, then forward it byte for byte."""

from __future__ import annotations

from gateway.asgi import Receive, Scope, Send, read_body
from gateway.proxy import UpstreamProxy


class Admission:
    def __init__(self, proxy: UpstreamProxy) -> None:
        self.proxy = proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        await self.proxy.forward(scope, receive, send, body=body)
