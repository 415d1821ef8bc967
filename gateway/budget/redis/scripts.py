"""What the budget's Lua scripts are and what they say: their sources (`gateway/budget/lua/`), the keys they keep
under the prefix, how a reserve call names its tenant and band, and the shape of their replies."""

from __future__ import annotations

import importlib.resources

from gateway.config import Band
from gateway.tenants import Tenant

# The keys under `<base>:`, where <base> is the key prefix inside one hash tag (`{mmgate:budget}`):
#   queue          sorted set, ticket id -> arrival number (INCR of `seq`): every waiting ticket (the queue's
#                  length and bound, and the authority on whether a ticket still waits)
#   ticket_expiry  sorted set, ticket id -> expiry (ms, Redis server time)
#   tickets        hash, ticket id -> "bytes band weight own_cap max_waiting label_length label tenant": the bytes
#                  asked for, and its tenant, class and band as its reserve call sent them (-1: no bound)
#   q:<band>:<tenant>
#                  sorted set, ticket id -> arrival number: one tenant's tickets in one band (0 interactive,
#                  1 batch), FIFO; the tenant id is taken as it is, after the tag (Redis keys are binary-safe, and
#                  the band is one character, so no two (band, tenant) pairs share a name)
#   waiting:<band> set of the classes with tickets in the band
#   h:<band>:<label>
#                  sorted set: the head ticket of each waiting tenant of the class, by virtual finish
#   starts         hash, head ticket id -> its virtual start
#   fair           hash: each band's virtual clock, each class's state in it and each class's expected hold of a
#                  grant (ms, an average of the releases made while tickets wait; `lua/fair.lua`)
#   lease_expiry   sorted set, lease id -> expiry (ms); a granted ticket becomes the lease with the same id
#   leases         hash, lease id -> "bytes seconds microseconds tenant": the bytes held, since when (Redis
#                  TIME), for whom
#   tenants        hash, tenant -> three little-endian doubles and its class's label: the bytes its leases hold,
#                  where its last grant finished in each band (`lua/tenants.lua`); at most `max_tenants` of them
#   idle           sorted set, tenant -> when it went idle: the tenants that hold and wait for nothing and keep a
#                  record for their lead, the least recently active first
#   used           string: the sum of the leases' bytes
#   seq            string: the arrival counter
#   gone           sorted set, id -> expiry (ms): ids abandoned, which a late reserve call must not queue
#   meta           hash: the cap every caller shares, the epoch of this incarnation of the state, when it was
#                  created, until when nothing is granted (after Redis lost the state)
#   gateways       sorted set, process id -> until when it counts as sharing the budget (ms), and
#   gateway_info   hash, process id -> what it says of itself (host, pid, what it fronts): `lua/members.lua`
# and the pub/sub channel `<base>:granted`.
KEY_NAMES = (
    "queue",
    "ticket_expiry",
    "tickets",
    "lease_expiry",
    "leases",
    "tenants",
    "idle",
    "fair",
    "starts",
    "used",
    "seq",
    "gone",
    "meta",
    "gateways",
    "gateway_info",
)

# One script per decision, each atomic and one round trip.
_SCRIPT_NAMES = ("reserve", "release", "abandon", "heartbeat", "snapshot")
# What every script is made of before its own body, in this order (a Lua local is seen only after it).
_SHARED = ("prelude", "tenants", "fair", "queue")


def _scripts() -> dict[str, str]:
    """Each script's source, from the `.lua` files of `gateway/budget/lua/`: its own body's first line (`#!lua` and
    its flags), the shared parts, then its body."""
    lua = importlib.resources.files("gateway.budget").joinpath("lua")
    shared = "".join(lua.joinpath(f"{part}.lua").read_text(encoding="utf-8") for part in _SHARED)
    scripts = {}
    for name in _SCRIPT_NAMES:
        shebang, _, body = lua.joinpath(f"{name}.lua").read_text(encoding="utf-8").partition("\n")
        scripts[name] = f"{shebang}\n{shared}{body}"
    return scripts


SCRIPTS = _scripts()
# Who shares the budget: no part of a decision, so called apart from the pipelined scripts (redis-py's own path).
MEMBERS = importlib.resources.files("gateway.budget").joinpath("lua", "members.lua").read_text(encoding="utf-8")

# The reserve script's status.
GRANTED, QUEUED, QUEUE_FULL, GONE, TENANT_FULL = 1, 0, -1, -2, -3
BANDS = {Band.INTERACTIVE: 0, Band.BATCH: 1}
# Where a script's own answers start in its reply, after the cluster's state, the epoch and the tenant records.
OWN = 8


def who(tenant: Tenant, band: Band) -> str:
    """What a reserve call tells the scripts of its tenant and band: "band weight own_cap max_waiting label_length
    label tenant", -1 for no bound; the class's label and the tenant's id go last, as they are (they may hold
    spaces), the label's length in bytes telling them apart."""
    cap = -1 if tenant.max_bytes_in_use is None else tenant.max_bytes_in_use
    waiting = -1 if tenant.max_waiting is None else tenant.max_waiting
    label = tenant.label
    return f"{BANDS[band]} {tenant.weight!r} {cap} {waiting} {len(label.encode())} {label}{tenant.id}"


def key_base(prefix: str) -> str:
    """The prefix with one hash tag, so a Redis Cluster keeps every key in one slot (a script may touch only one
    slot): its own when it has one (a `{` and, after it, a `}` with something between), else the whole prefix.
    Every key starts with the base, so nothing after it (a tenant's id) moves the key to another slot."""
    start = prefix.find("{")
    if start >= 0 and prefix.find("}", start + 1) > start + 1:
        return prefix
    return "{" + prefix + "}"
