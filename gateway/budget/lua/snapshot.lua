-- ARGV: cap, ttl_ms. Reaps and grants, and answers the cluster's state.
reap()
reap_tombstones()
grant()
return finish({})
