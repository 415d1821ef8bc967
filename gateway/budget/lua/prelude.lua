-- Shared by every script: clock, the budget's record, and reading what a call says of its tenant. Every script is
-- this, tenants.lua (tenant records), fair.lua (the fair queue), queue.lua (leases, tickets, grants) and its own
-- body. The scripts get the base as their one key (one argument to encode instead of one a name: the encoding is
-- a large part of a call's client cost) and derive the rest; every name starts with the base and its hash tag, so
-- all of them live in the slot of the declared key, whatever follows the tag (a tenant's id).
local base = KEYS[1]
local K_QUEUE, K_TEXP, K_TICKETS = base .. ':queue', base .. ':ticket_expiry', base .. ':tickets'
local K_LEXP, K_LEASES, K_USED = base .. ':lease_expiry', base .. ':leases', base .. ':used'
local K_TENANTS, K_IDLE, K_FAIR, K_STARTS = base .. ':tenants', base .. ':idle', base .. ':fair', base .. ':starts'
local K_SEQ, K_GONE, K_META, CHANNEL = base .. ':seq', base .. ':gone', base .. ':meta', base .. ':granted'
-- The bands, interactive first, and the set of classes with tickets in each.
local BANDS = {'0', '1'}
local K_WAITING = {['0'] = base .. ':waiting:0', ['1'] = base .. ':waiting:1'}
-- As the local backend: the expected hold before the first release (ms) and the weight of each release in its
-- average.
local INITIAL_HOLD_MS, HOLD_EWMA = 1000, 0.05
-- fair_queue.py FINISH_TIE: virtual finishes this close, relative to their size, differ only by rounding.
local FINISH_TIE = 1e-9
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
-- `now` as a lease's record writes it: seconds and microseconds, as TIME answers them (no number to format).
local now_text = clock[1] .. ' ' .. clock[2]
-- ARGV[1..5] of every script: the caller's cap, its lease TTL (ms), the epoch of the budget's record it last
-- saw ('' before its first reply), how long an idle tenant's lead is kept (s), and how many tenant records are.
local cap = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
local known_epoch = ARGV[3]
local window_ms = tonumber(ARGV[4]) * 1000
local max_tenants = tonumber(ARGV[5])

-- The budget's record: the cap every caller must share, an epoch that names this incarnation of the state, when
-- it was created and until when nothing is granted. It lives three TTLs from its creation and from each heartbeat (every process sends one every
-- TTL / 3), so a cap can change once every process of the old one is gone.
local meta = redis.call('HMGET', K_META, 'cap', 'epoch', 'created', 'settle_until')
if meta[1] and tonumber(meta[1]) ~= cap then
    return {'cap', meta[1]}
end
local epoch, created, settle_until = meta[2], tonumber(meta[3] or '0'), tonumber(meta[4] or '0')
if not epoch then
    -- No record: a new budget, or Redis lost its state (a restart without persistence, a flush, an eviction).
    epoch, created, settle_until = clock[1] .. '.' .. clock[2], now, 0
end
local reassert = known_epoch ~= '' and known_epoch ~= epoch
if reassert then
    -- The caller held state that this incarnation does not have, and so may every other process: nothing is
    -- granted for one lease TTL from the record's creation, in which each live holder re-asserts its leases with
    -- its next renewal (a holder silent for that long has lost them anyway).
    settle_until = math.max(settle_until, created + ttl)
end
local function keep_record()
    redis.call('PEXPIRE', K_META, 3 * ttl)
end
if not meta[2] or reassert then
    redis.call('HSET', K_META, 'cap', cap, 'epoch', epoch, 'created', created, 'settle_until', settle_until)
    keep_record()
end
local settled = now >= settle_until
local used = tonumber(redis.call('GET', K_USED) or '0')
local used_before = used
local qlen = redis.call('ZCARD', K_QUEUE)
local reaped_leases, reaped_tickets = 0, 0
local granted = {}

-- What a reserve call says of its tenant and band: 'band weight own_cap max_waiting label_length label tenant' (-1:
-- no bound; the class's label and the tenant's id as they are, the label's length in bytes telling them apart). A
-- ticket's record in K_TICKETS is its bytes and that; a lease's in K_LEASES 'bytes seconds microseconds tenant'
-- (when it was granted, as TIME answered).
local function parse_who(who)
    local band, weight, own_cap, max_waiting, length, rest = string.match(who, '^(%S+) (%S+) (%S+) (%S+) (%d+) (.*)$')
    length = tonumber(length)
    return band, tonumber(weight), tonumber(own_cap), tonumber(max_waiting), string.sub(rest, 1, length),
        string.sub(rest, length + 1)
end

local function parse_ticket(record)
    local n, who = string.match(record, '^(%S+) (.*)$')
    return tonumber(n), parse_who(who)
end

-- A tenant's tickets of each band wait in the sorted set queue_key(band, tenant) by arrival.
local function queue_key(band, tenant)
    return base .. ':q:' .. band .. ':' .. tenant
end

local function tenant_waiting(tenant)
    return redis.call('ZCARD', queue_key('0', tenant)) + redis.call('ZCARD', queue_key('1', tenant))
end
