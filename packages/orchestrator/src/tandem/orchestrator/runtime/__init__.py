"""Process-level settings and helpers: torch's thread count for a stage (`threads`), a lower
CPU priority for trainer ranks (`priority`), glibc's heap keeping freed memory
(`allocator`), cancelling background tasks for sure (`cancel`), and the weight store's
retry backoff (`backoff`). Only process entry points change process-wide state."""
