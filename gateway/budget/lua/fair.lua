-- The fair queue, as gateway/budget/fair_queue.py describes it: classes share the cap by weight, the tenants of a
-- class share it equally, both in virtual time, each band on clocks of its own.
--   K_FAIR             hash: 'V:<band>' -> the band's clock and the latest class finish it handed out ('<dd');
--                      '<band>:<label>' -> the class: where it starts while it waits, where its last grant
--                      finished, its own clock, the latest finish it handed out, its weight ('<ddddd');
--                      'H:<label>' -> the class's expected hold of a grant (ms, '<d'); 'H' -> every class's
--                      together
--   K_WAITING[band]    set of the classes with tickets waiting in the band
--   heads_key(band, label)
--                      sorted set, one entry a waiting tenant of the class: its head ticket, named by its arrival
--                      (16 digits, so that a tie goes to the earlier) and id, scored by its virtual finish
--   K_STARTS           hash, head ticket id -> its virtual start
-- What a call reads of K_FAIR it keeps, and finish() writes back what changed. The functions are made on a call's
-- first use (fair_queue()): making a closure costs Redis about 0.2 us, and a call while nobody waits needs none.
local fair

local function fair_queue()
    if fair then return fair end
    local classes, clocks, changed_classes, changed_clocks = {}, {}, {}, {}
    local holds, changed_holds = {}, {}

    local function heads_key(band, label)
        return base .. ':h:' .. band .. ':' .. label
    end

    local function head_member(seq, id)
        return string.format('%016d', seq) .. id
    end

    local function float(value)
        return string.format('%.17g', value)
    end

    local function class_of(band, label)
        local field = band .. ':' .. label
        local class = classes[field]
        if not class then
            class = {field = field}
            local record = redis.call('HGET', K_FAIR, field)
            if record then
                class.start, class.finish, class.vtime, class.fmax, class.weight = struct.unpack('<ddddd', record)
            else
                class.start, class.finish, class.vtime, class.fmax, class.weight = 0, 0, 0, 0, 1
            end
            classes[field] = class
        end
        return class
    end

    local function clock_of(band)
        local clock = clocks[band]
        if not clock then
            clock = {}
            local record = redis.call('HGET', K_FAIR, 'V:' .. band)
            if record then
                clock.v, clock.fmax = struct.unpack('<dd', record)
            else
                clock.v, clock.fmax = 0, 0
            end
            clocks[band] = clock
        end
        return clock
    end

    local function hold_ms(field)
        -- A class's expected hold: the average of its releases from the first; every class's until its first; 1 s
        -- before any.
        local hold = holds[field]
        if hold == nil then
            local record = redis.call('HGET', K_FAIR, field)
            hold = record and struct.unpack('<d', record)
            holds[field] = hold or false
        end
        if hold then return hold end
        return field == 'H' and INITIAL_HOLD_MS or hold_ms('H')
    end

    local function class_hold_ms(label)
        return hold_ms('H:' .. label)
    end

    local function held(label, held_ms)
        -- A grant of the class held its bytes `held_ms`: the class's expected hold, and every class's, follow.
        for _, field in ipairs({'H:' .. label, 'H'}) do
            hold_ms(field)
            local hold = holds[field]
            holds[field] = hold and hold + HOLD_EWMA * (held_ms - hold) or held_ms
            changed_holds[field] = true
        end
    end

    local function save_fair()
        for field, class in pairs(changed_classes) do
            redis.call('HSET', K_FAIR, field,
                struct.pack('<ddddd', class.start, class.finish, class.vtime, class.fmax, class.weight))
        end
        for band, clock in pairs(changed_clocks) do
            redis.call('HSET', K_FAIR, 'V:' .. band, struct.pack('<dd', clock.v, clock.fmax))
        end
        for field in pairs(changed_holds) do
            redis.call('HSET', K_FAIR, field, struct.pack('<d', holds[field]))
        end
    end

    local function tenant_leads(label, f0, f1)
        return (f0 > 0 and f0 > class_of('0', label).vtime) or (f1 > 0 and f1 > class_of('1', label).vtime)
    end

    local function make_head(band, label, weight, tenant, id, n, seq)
        -- Ticket `id` is its tenant's first in the band: it starts at the later of its class's clock and where the
        -- tenant's last grant finished, and finishes its bytes later.
        local class = class_of(band, label)
        class.weight = weight
        if redis.call('SADD', K_WAITING[band], label) == 1 then
            class.start = math.max(clock_of(band).v, class.finish)
        end
        local _, f0, f1 = tenant_state(tenant)
        local start = math.max(class.vtime, band == '0' and f0 or f1)
        local finish = start + n
        if finish > class.fmax then class.fmax = finish end
        changed_classes[class.field] = class
        redis.call('HSET', K_STARTS, id, float(start))
        redis.call('ZADD', heads_key(band, label), float(finish), head_member(seq, id))
    end

    local function head_left(band, label, tenant, id, seq)
        -- Ticket `id`, its tenant's head, has left the tenant's queue: the tenant's next ticket becomes its head; with
        -- none in the class, the class stops waiting and its clock moves past every finish it handed out (no lead
        -- outlives contention), and with no class waiting, so does the band's.
        redis.call('ZREM', heads_key(band, label), head_member(seq, id))
        redis.call('HDEL', K_STARTS, id)
        local next_ticket = redis.call('ZRANGE', queue_key(band, tenant), 0, 0, 'WITHSCORES')
        local record = next_ticket[1] and redis.call('HGET', K_TICKETS, next_ticket[1])
        if record then
            local n, _, weight, _, _, next_label = parse_ticket(record)
            make_head(band, next_label, weight, tenant, next_ticket[1], n, tonumber(next_ticket[2]))
        end
        if redis.call('ZCARD', heads_key(band, label)) == 0 then
            local class = class_of(band, label)
            redis.call('SREM', K_WAITING[band], label)
            if class.fmax > class.vtime then class.vtime = class.fmax end
            changed_classes[class.field] = class
            if redis.call('SCARD', K_WAITING[band]) == 0 then
                local clock = clock_of(band)
                if clock.fmax > clock.v then clock.v = clock.fmax end
                changed_clocks[band] = clock
            end
        end
    end

    local function class_head(band, label)
        -- The class's head with the least virtual finish (the earliest on a tie) whose tenant is within its own cap,
        -- as {id, bytes, tenant, arrival, start, finish}, or nil.
        local key = heads_key(band, label)
        local from = 0
        while true do
            local entries = redis.call('ZRANGE', key, from, from + 15, 'WITHSCORES')
            if not entries[1] then return nil end
            for i = 1, #entries, 2 do
                local id = string.sub(entries[i], 17)
                local record = redis.call('HGET', K_TICKETS, id)
                if record then
                    local n, _, _, own_cap, _, _, tenant = parse_ticket(record)
                    if own_cap < 0 or tenant_state(tenant) + n <= own_cap then
                        return {id = id, n = n, tenant = tenant, seq = tonumber(string.sub(entries[i], 1, 16)),
                            start = tonumber(redis.call('HGET', K_STARTS, id)), finish = tonumber(entries[i + 1])}
                    end
                end
            end
            from = from + 16
        end
    end

    local function next_head(band)
        -- The head the next grant in the band goes to and its class, or nil: the head that would finish first on
        -- the band's clock (the earliest arrival on a tie). The clock never falls behind the earliest start waiting
        -- on it.
        local labels = redis.call('SMEMBERS', K_WAITING[band])
        if not labels[1] then return nil end
        local clock = clock_of(band)
        local earliest, weights = nil, 0
        for _, label in ipairs(labels) do
            local class = class_of(band, label)
            if not earliest or class.start < earliest then earliest = class.start end
            weights = weights + class.weight
        end
        if earliest > clock.v then
            clock.v = earliest
            changed_clocks[band] = clock
        end
        local best, best_class, best_key
        for _, label in ipairs(labels) do
            local class = class_of(band, label)
            local head = class_head(band, label)
            if head then
                local key = class.start + head.n * class_hold_ms(string.sub(class.field, 3)) / 1000 / class.weight
                -- A tie (equal but for rounding: fair_queue.py finishes_first) goes to the earlier arrival.
                local tie = best and math.abs(key - best_key) <= FINISH_TIE * math.max(math.abs(key), math.abs(best_key))
                if not best or (tie and head.seq < best.seq) or (not tie and key < best_key) then
                    best, best_class, best_key = head, class, key
                end
            end
        end
        if best then best.label, best.weights = string.sub(best_class.field, 3), weights end
        return best, best_class
    end

    local function moved(band, class, head)
        -- The clocks after `head` of `class` is granted, before it leaves the queue: its tenant's last finish is its
        -- own, its class's clock moves by its bytes over the class's waiting tenants (not behind where it started),
        -- the band's by its cost (bytes times the class's expected hold) over the waiting classes' weights.
        local in_use, f0, f1, label = tenant_state(head.tenant)
        if band == '0' then f0 = head.finish else f1 = head.finish end
        set_tenant(head.tenant, in_use, f0, f1, label or '')
        local class_label = string.sub(class.field, 3)
        local waiting = redis.call('ZCARD', heads_key(band, class_label))
        class.vtime = math.max(class.vtime + head.n / waiting, head.start)
        local cost = head.n * class_hold_ms(class_label) / 1000
        class.finish = class.start + cost / class.weight
        local clock = clock_of(band)
        clock.v = clock.v + cost / head.weights
        if class.finish > clock.fmax then clock.fmax = class.finish end
        changed_classes[class.field], changed_clocks[band] = class, clock
    end

    local function restart(band, class)
        -- A class still waiting after a grant starts again at the later of the band's clock and its last finish.
        if redis.call('SISMEMBER', K_WAITING[band], string.sub(class.field, 3)) == 1 then
            class.start = math.max(clock_of(band).v, class.finish)
            changed_classes[class.field] = class
        end
    end

    local function sweep(count)
        -- Forgets, among the `count` idle tenants idle longest, those whose lead is gone or older than the window.
        local oldest = redis.call('ZRANGE', K_IDLE, 0, count - 1, 'WITHSCORES')
        for i = 1, #oldest, 2 do
            local tenant = oldest[i]
            local in_use, f0, f1, label = tenant_state(tenant)
            if not label or in_use > 0 or tenant_waiting(tenant) > 0 then
                redis.call('ZREM', K_IDLE, tenant)
            elseif now - tonumber(oldest[i + 1]) >= window_ms or not tenant_leads(label, f0, f1) then
                forget_tenant(tenant, true)
            end
        end
    end

    local function settle(tenant, in_use, f0, f1, label)
        -- The tenant's record (`in_use` and the rest as it should be now), which was busy: while it holds or waits
        -- for bytes it is kept; then it stays, idle, while it leads its class's clock, and goes otherwise.
        if in_use > 0 or (qlen > 0 and tenant_waiting(tenant) > 0) then
            set_tenant(tenant, in_use, f0, f1, label)
        elseif tenant_leads(label, f0, f1) then
            set_tenant(tenant, 0, f0, f1, label)
            redis.call('ZADD', K_IDLE, now, tenant)
            -- Past half of max_tenants, two of the tenants idle longest go when their lead has: the sweep keeps
            -- pace.
            if 2 * make_room() >= max_tenants then sweep(2) end
        else
            forget_tenant(tenant, false)
        end
    end

    local function left_queue(tenant)
        -- A ticket of the tenant left the queue without a grant.
        local in_use, f0, f1, label = tenant_state(tenant)
        if label and in_use <= 0 and tenant_waiting(tenant) == 0 then settle(tenant, 0, f0, f1, label) end
    end

    fair = {make_head = make_head, head_left = head_left, next_head = next_head, moved = moved, restart = restart,
        held = held, save = save_fair, sweep = sweep, settle = settle, left_queue = left_queue}
    return fair
end

local function discharge(tenant, n)
    -- A lease of `n` bytes of the tenant has ended. With nobody waiting, every class's clock has passed every
    -- finish: a tenant that holds nothing more leads no clock, and its record goes.
    local in_use, f0, f1, label = tenant_state(tenant)
    if not label then return end
    in_use = in_use - n
    if in_use <= 0 and qlen == 0 then
        forget_tenant(tenant, false)
    else
        fair_queue().settle(tenant, math.max(in_use, 0), f0, f1, label)
    end
end
