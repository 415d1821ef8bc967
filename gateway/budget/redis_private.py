"""What the script pipeline takes from redis-py beyond its documented API: a connection's socket.

`gateway.budget.redis_pipeline` lets redis-py open a connection (so AUTH, SELECT, TLS and the connect timeout follow
the URL), then takes over its transport; nothing else reaches into redis-py's internals. An upgrade of redis-py
that changes anything listed here breaks the pipeline first, and here. Tested with redis-py 5.1.1 and 8.2.0, the
bounds in pyproject.toml (5.0.0 and 5.0.1 have no `_close`); `make newest-deps` (CI, after `make test`) runs the
Redis budget's tests against the newest release and says when it breaks them.

It relies on, of `redis.asyncio.connection`:

- `ConnectionPool.connection_class` and `.connection_kwargs` (with its `socket_timeout`): how the pool makes its
  connections.
- `AbstractConnection.connect()` opening the socket with `asyncio.open_connection`, and the private `_writer`,
  the `asyncio.StreamWriter` it keeps: its transport is handed to another protocol after the connect.
- The private `AbstractConnection._close()`: closes the writer (and so the socket) without awaiting anything,
  which a protocol callback needs.
"""

from __future__ import annotations

import asyncio
from typing import cast

from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError


def socket_timeout(pool: ConnectionPool) -> float | None:
    """The socket timeout `pool`'s connections are made with (None: none)."""
    timeout: float | None = pool.connection_kwargs.get("socket_timeout")
    return timeout


async def connect_like(pool: ConnectionPool) -> AbstractConnection:
    """A new connection, made and connected as `pool` makes its own, that the pool does not hold."""
    connection: AbstractConnection = pool.connection_class(**pool.connection_kwargs)
    await connection.connect()  # type: ignore[no-untyped-call]
    return connection


def transport_of(connection: AbstractConnection) -> asyncio.Transport:
    """The connected `connection`'s transport, for another protocol to take over (`transport.set_protocol`)."""
    writer = connection._writer
    if writer is None:
        raise RedisConnectionError("the connection to Redis closed before its first command")
    return cast(asyncio.Transport, writer.transport)


def close_now(connection: AbstractConnection) -> None:
    """Close the connection's socket at once, from a callback that cannot await."""
    connection._close()  # type: ignore[no-untyped-call]
