-- ARGV: cap, ttl_ms, epoch, window_s, id. Answers the bytes freed (-1 when the lease had already gone).
local freed = drop_lease(ARGV[5], true)
reap()
grant()
return finish({freed})
