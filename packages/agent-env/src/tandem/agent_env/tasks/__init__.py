"""Task sources: generated bug-fix tasks (one bug, or several spread over modules in
`multibug`), bugs injected into real stdlib code, and SWE-bench-style records."""
