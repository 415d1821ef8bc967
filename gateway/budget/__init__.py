"""The process-wide media byte budget (`limits.max_multimodal_cpu_bytes`): the interface (`base`), its backends
(`local`, one process; `redis`, shared by every worker and replica), the one that runs (`factory`), and its metrics
and readiness (`reporter`)."""
