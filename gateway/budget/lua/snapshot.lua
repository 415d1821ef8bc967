#!lua flags=allow-oom
-- ARGV: cap, ttl_ms, epoch, window_s, max_tenants. Reaps and grants (a grant turns a ticket into a lease, no larger),
-- and answers the cluster's state.
count_tenants = true
keep_record()
reap()
reap_tombstones()
grant()
return finish({})
