"""`gateway.budget.redis_private`: what the script pipeline takes of redis-py's internals, against a real
`redis-server` on a free loopback port and the redis-py installed (`make newest-deps` runs it on the newest)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.budget import redis_private
from tests.redis_server import RedisServer


class _Replies(asyncio.Protocol):
    def __init__(self) -> None:
        self.data = b""
        self.arrived = asyncio.Event()
        self.lost = asyncio.Event()

    def data_received(self, data: bytes) -> None:
        self.data += data
        self.arrived.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set()


async def test_a_connection_made_like_the_pools_hands_over_its_socket_and_closes_at_once(
    redis_server: RedisServer,
) -> None:
    pool = aioredis.BlockingConnectionPool.from_url(redis_server.url, socket_timeout=1.5, decode_responses=True)
    assert redis_private.socket_timeout(pool) == 1.5
    connection = await redis_private.connect_like(pool)
    try:
        assert connection.is_connected
        transport = redis_private.transport_of(connection)
        replies = _Replies()
        transport.set_protocol(replies)
        # What redis-py's connect said (HELLO, CLIENT SETINFO) has been answered: the next reply is this command's.
        transport.write(b"*1\r\n$4\r\nPING\r\n")
        await asyncio.wait_for(replies.arrived.wait(), 5)
        assert replies.data == b"+PONG\r\n"

        redis_private.close_now(connection)
        assert transport.is_closing()
        assert not connection.is_connected
        await asyncio.wait_for(replies.lost.wait(), 5)
    finally:
        await connection.disconnect()
        await pool.aclose()


async def test_a_connection_not_connected_has_no_transport_to_hand_over(redis_server: RedisServer) -> None:
    pool = aioredis.BlockingConnectionPool.from_url(redis_server.url)
    connection = pool.connection_class(**pool.connection_kwargs)
    with pytest.raises(RedisConnectionError, match="closed before its first command"):
        redis_private.transport_of(connection)
    await pool.aclose()
