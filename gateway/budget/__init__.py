"""The process-wide media byte budget (`limits.max_multimodal_cpu_bytes`): the interface (`base`), its backends
(`local`, one process; `redis`, shared by every worker and replica), the one that runs (`factory`), its metrics and
readiness (`reporter`), and the bound on the bodies of requests that wait for it (`queued_bodies`)."""
