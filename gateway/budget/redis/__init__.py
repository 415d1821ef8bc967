"""The media byte budget shared by every gateway process and replica through Redis.

`RedisBudget` implements the `MediaBudget` contract of `gateway.budget.base` with the local backend's fair queue
(`gateway.budget.fair_queue`), across every process that uses the same key prefix: classes share the cap by weight
and the tenants of a class share it equally, in virtual time, FIFO within a tenant, with no overtaking of the
request the queue puts first; a tenant at its own `max_bytes_in_use` is passed over without blocking the others;
a waiting interactive request goes before any batch one, and no batch request is granted while an interactive head
waits for room. One tenant in one band is one FIFO queue. An admission timeout per band, a queue bound and the
tenants' own bounds are answered with 429. At most `max_tenants` tenant records are kept in Redis.

Everything a decision reads or writes lives under the prefix and changes only inside one Lua script per operation
(reserve, release, abandon, heartbeat, snapshot: `lua/*.lua`, loaded by `scripts`), so each operation is atomic and
one round trip. Every script first renews what its caller still holds, then drops expired leases and queue
tickets, then grants in fair order while the chosen head fits, then does its own work. A reserve call carries its
tenant's id, class, weight and bounds and its band; the ticket keeps them, so every later grant step uses them; a
lease keeps its tenant, so its release or its expiry settles that tenant's record. Only the reserve script may need
memory for its caller: under `maxmemory`, Redis refuses it (503) while every other script runs (`allow-oom`), since
they free memory or keep what exists, so the budget recovers by itself once memory frees.

Leases and tickets expire: a reservation is a lease that its process renews every `lease_ttl_s / 3`, a queued
request is a ticket it refreshes at the same pace (`keeper`), so the bytes and the places of a process that dies
(`kill -9`) come back once its last renewal runs out, whoever calls next. Times are Redis server time (`TIME` inside
the scripts), so the clocks of the gateway hosts do not matter.

Grants happen inside the scripts; each script that grants publishes the granted ticket ids on `<prefix>:granted`,
where every process listens (`listener`) and hands the reservation to its waiter at once. A process also re-checks
its own tickets at each renewal and wakes when the earliest lease or ticket in Redis is due to expire, which covers
a lost message and a dead process's bytes, without polling in a tight loop.

When Redis does not answer, `on_unavailable` decides (`fallback`): `"reject"` refuses with
`BudgetBackendUnavailable` (503), `"local"` serves from a per-process `LocalBudget` of
`capacity // expected_replicas` until Redis answers again.

The modules: `budget` (`RedisBudget`: reserve, wait, abandon, life cycle), `client` (the script client and the
cluster's state from its replies), `scripts` (the Lua sources, the keys, the wire format), `leases` (what this
process holds and waits for), `releases`, `keeper` (the lease keeper), `listener` (the grant listener), `fallback`,
`members` (who shares the budget), `metrics` (its counters and gauges), `background` (its background calls).
"""

from gateway.budget.redis.budget import RedisBudget
from gateway.budget.redis.client import BudgetBackendUnavailable, BudgetMisconfigured
from gateway.budget.redis.metrics import RedisBudgetStats

__all__ = ["BudgetBackendUnavailable", "BudgetMisconfigured", "RedisBudget", "RedisBudgetStats"]
