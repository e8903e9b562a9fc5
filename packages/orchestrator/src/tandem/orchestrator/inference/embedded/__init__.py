"""The embedded engine, bitwise equal to the trainer: `engine.InferenceEngine` (batched
decoding, one KV-cache slot per episode, weight updates applied between decoding steps),
`prefix_cache.PrefixIndex` (a turn copies what another slot already computed) and
`server.EngineServer` (the asyncio front episodes await, with pulls from the weight stream).
"""
