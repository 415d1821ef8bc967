-- ARGV: cap, ttl_ms, epoch, window_s. Reaps and grants, and answers the cluster's state.
keep_record()
reap()
reap_tombstones()
grant()
return finish({})
