"""The codec: what turns a state and its base into delta bytes, and those bytes back into
the new state, bit for bit.

Every tensor is read as the unsigned bit patterns of its elements and cut into fixed-size
chunks; each chunk is stored as the smallest of unchanged, sparse, XOR or raw, every
integer stream as zstd frames of its byte planes, and the chunks of many tensors are
packed into content-addressed shards. Decoding stages the shards as a compact patch that
is applied in place, hashed and verified (and undone on a digest mismatch).

* `frames`: the chunk modes, the record of an encoded chunk, its zstd byte-plane frames.
* `chunk`: one chunk's encodings in whole-array numpy (the reference) and the mode choice.
* `sparse`: the sparse encoding through the compiled kernels, which publish and pull run.
* `kernels`: those compiled single-pass loops (numba, imported on first use).
* `container`: the shard layout (a header of chunk records, then their frames).
* `encoder`: a whole state against its base into shards, chunk by chunk in parallel.
* `patch`: shards staged into a patch, then applied to a state and verified.
"""
