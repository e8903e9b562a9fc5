"""Helpers for tests and benchmarks, not for production: an emulated wide-area network
(network namespaces, `tc tbf` rate limits, a round-trip/reset proxy) and the processes
that run in it (`wan.Wan`). They need root; `netns.unavailable()` says why not."""
