#!lua flags=allow-oom
-- ARGV: cap, ttl_ms, epoch, window_s, max_tenants, id. Answers the bytes freed (-1 when the lease had already gone).
-- It frees memory, so it runs when Redis is past its maxmemory too.
local freed = drop_lease(ARGV[6], true)
reap()
grant()
return finish({freed})
