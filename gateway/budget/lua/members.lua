-- Which gateway processes share this budget, apart from its scripts: each process names itself here at start-up and
-- with every heartbeat, and is forgotten once it has not for its TTL. KEYS[1]: the base. ARGV: the process's id,
-- what it says of itself, how long that holds (ms; 0: it leaves now). Answers what every process present says.
local base = KEYS[1]
local K_GATEWAYS, K_INFO = base .. ':gateways', base .. ':gateway_info'
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local ttl = tonumber(ARGV[3])
local gone = redis.call('ZRANGEBYSCORE', K_GATEWAYS, '-inf', now)
for _, id in ipairs(gone) do
    redis.call('HDEL', K_INFO, id)
end
redis.call('ZREMRANGEBYSCORE', K_GATEWAYS, '-inf', now)
if ttl > 0 then
    redis.call('ZADD', K_GATEWAYS, now + ttl, ARGV[1])
    redis.call('HSET', K_INFO, ARGV[1], ARGV[2])
    redis.call('PEXPIRE', K_GATEWAYS, ttl)
    redis.call('PEXPIRE', K_INFO, ttl)
else
    redis.call('ZREM', K_GATEWAYS, ARGV[1])
    redis.call('HDEL', K_INFO, ARGV[1])
end
local said = {}
for _, id in ipairs(redis.call('ZRANGE', K_GATEWAYS, 0, -1)) do
    said[#said + 1] = redis.call('HGET', K_INFO, id) or id
end
return said
