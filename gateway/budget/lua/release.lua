-- ARGV: cap, ttl_ms, epoch, id. Answers the bytes freed (-1 when the lease had already gone).
local freed = drop_lease(ARGV[4])
reap()
grant()
return finish({freed})
