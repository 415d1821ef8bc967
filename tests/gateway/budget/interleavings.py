"""The properties both media budgets are held to. Capacity conservation: random interleavings of clients asking for
bytes (through `until_disconnect`, as the gateway does, or bare), connections dropping, tasks cancelled, holders
releasing, and the event loop running (zero-delay turns, or long enough for admission timeouts to fire). No
starvation between tenants and bands, and shares under contention that follow the tenants' weights."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from hypothesis import strategies as st

from gateway.budget.base import MediaBudget, Reservation
from gateway.config import Band
from gateway.errors import RateLimited
from gateway.tenants import DEFAULT_TENANT, Tenant
from serving.asgi import ClientDisconnected, until_disconnect

Op = tuple[str, int, int]


def operations(max_size: int) -> st.SearchStrategy[list[Op]]:
    return st.lists(
        st.one_of(
            st.tuples(st.just("reserve"), st.integers(0, 5), st.integers(1, 100)),
            st.tuples(st.just("reserve_bare"), st.integers(0, 5), st.integers(1, 100)),
            st.tuples(st.sampled_from(["disconnect", "cancel", "release"]), st.integers(0, 5), st.just(0)),
            st.tuples(st.just("turns"), st.integers(1, 3), st.just(0)),
            st.tuples(st.just("sleep"), st.integers(1, 4), st.just(0)),
        ),
        max_size=max_size,
    )


class Client:
    """An ASGI `receive` whose disconnect the test triggers."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> dict[str, str]:
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def interleave(
    budget: MediaBudget,
    ops: list[Op],
    *,
    capacity: int,
    check: Callable[[], None] | None = None,
    tenant_of: Callable[[int], tuple[Tenant, Band]] = lambda i: (DEFAULT_TENANT, Band.INTERACTIVE),
) -> None:
    """Run `ops` against `budget` (of `capacity` bytes), client `i` reserving for `tenant_of(i)`: what it holds
    never passes the capacity nor falls below what clients were handed, and once every client is gone it holds
    nothing and nobody waits."""
    clients: dict[int, Client] = {}
    tasks: dict[int, asyncio.Task[None]] = {}
    every_task: list[asyncio.Task[None]] = []
    held: dict[int, list[Reservation]] = {}

    async def ask(i: int, nbytes: int, bare: bool) -> None:
        tenant, band = tenant_of(i)
        try:
            if bare:
                reservation = await budget.reserve(nbytes, tenant=tenant, band=band)
            else:
                reservation = await until_disconnect(
                    budget.reserve(nbytes, tenant=tenant, band=band), clients[i].receive, discard=Reservation.release
                )
        except (ClientDisconnected, RateLimited):
            return
        held.setdefault(i, []).append(reservation)

    for op, i, n in ops:
        if op in ("reserve", "reserve_bare"):
            clients[i] = Client()
            tasks[i] = asyncio.ensure_future(ask(i, n, bare=op == "reserve_bare"))
            every_task.append(tasks[i])
        elif op == "disconnect" and i in clients:
            clients[i].gone.set()
        elif op == "cancel" and i in tasks:
            tasks[i].cancel()
        elif op == "release":
            for reservation in held.pop(i, []):
                reservation.release()
        elif op == "turns":
            for _ in range(i):
                await asyncio.sleep(0)
        elif op == "sleep":
            await asyncio.sleep(i / 1000)
        assert 0 <= budget.in_use <= capacity
        live = sum(r.nbytes for rs in held.values() for r in rs if not r.released)
        assert budget.in_use >= live
        if check is not None:
            check()
    for task in every_task:
        task.cancel()
    await asyncio.gather(*every_task, return_exceptions=True)
    for reservations in held.values():
        for reservation in reservations:
            reservation.release()
    assert (budget.in_use, budget.waiting) == (0, 0)


async def contend(
    budgets: list[MediaBudget], tenants: list[Tenant], *, grants: int, nbytes: int, hold_s: float, clients: int
) -> dict[str, int]:
    """Keep the budget saturated: `clients` clients per tenant, tenant `k`'s on `budgets[k % len(budgets)]`, each
    reserving `nbytes`, holding them `hold_s` and releasing, until `grants` grants in all; answers the grants of
    each tenant."""
    granted = dict.fromkeys((tenant.id for tenant in tenants), 0)

    async def client(budget: MediaBudget, tenant: Tenant) -> None:
        while sum(granted.values()) < grants:
            reservation = await budget.reserve(nbytes, tenant=tenant)
            granted[tenant.id] += 1
            await asyncio.sleep(hold_s)
            reservation.release()

    tasks = [
        asyncio.ensure_future(client(budgets[k % len(budgets)], tenant))
        for k, tenant in enumerate(tenants)
        for _ in range(clients)
    ]
    await asyncio.gather(*tasks)
    return granted


async def none_starve(
    budget: MediaBudget,
    asks: list[tuple[int, int]],
    releases: list[int],
    *,
    capacity: int,
    tenant_of: Callable[[int], tuple[Tenant, Band]],
    within_s: float,
) -> None:
    """Without timeouts, every request is granted as long as holders keep giving their bytes back: client `i` asks
    `n` bytes for `tenant_of(i)` per `(i, n)` of `asks`, some holders (`releases`, by index) give back early, then
    every holder gives back as soon as it is granted. `within_s` is a backstop for a budget whose grants take round
    trips."""
    tasks = [asyncio.ensure_future(budget.reserve(n, tenant=tenant_of(i)[0], band=tenant_of(i)[1])) for i, n in asks]
    await asyncio.sleep(0)
    for k in releases:
        task = tasks[k % len(tasks)]
        if task.done():
            task.result().release()
        await asyncio.sleep(0)
    pending = set(tasks)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while pending and loop.time() < deadline:
        for task in list(pending):
            if task.done():
                assert 0 <= budget.in_use <= capacity
                task.result().release()
                pending.discard(task)
        await asyncio.sleep(0.001)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    assert not pending, f"{len(pending)} starved with {budget.in_use} in use"
