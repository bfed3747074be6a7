"""The engine: FastCDC chunking, BLAKE3 and xxh3 hashing, basis reuse and sub-chunk deltas.

`chunking` (FastCDC with normalized chunking; Cython core `tb5sync._cdc` and a pure-Python
twin), `hashing` (digests and hashing threads), `basis`, `refine`, `gear`, `params`. Pure
computation over buffers and file descriptors; may import only `_os` and errors.
"""
