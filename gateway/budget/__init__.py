"""The process-wide media byte budget (`limits.max_multimodal_cpu_bytes`): the interface (`base`), its backends
(`local`, one process; `redis`, shared by every worker and replica), the one that runs (`factory`), its metrics and
readiness (`reporter`), and the bound on the raw request bodies a process holds (`bodies`), a byte budget too."""
