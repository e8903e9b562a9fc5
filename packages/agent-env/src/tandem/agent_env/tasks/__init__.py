"""Task sources: generated bug-fix tasks, bugs injected into real stdlib code, and
SWE-bench-style records."""
