-- ARGV: cap, ttl_ms, epoch. Reaps and grants, and answers the cluster's state.
reap()
reap_tombstones()
grant()
return finish({})
