"""vLLM as the inference engine (``engine.kind = "vllm"``).

`environment` (the vLLM environment tandem creates with uv and caches), `server` (a server
tandem starts on loopback), `serving` (the servers of a run: started, or given by URL) and
`engine` (the servers behind the `Engine` protocol, over HTTP). Nothing here imports vLLM:
it runs in its own environment and process.
"""
