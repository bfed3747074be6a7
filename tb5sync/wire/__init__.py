"""The wire: sans-IO frames and messages, URLs, sockets, RPC over channels.

`protocol` (frames, handshake) and `messages` (the vocabulary, reply types, limits) open no
socket, file or thread; `transport` (sockets, TLS, sendfile, timeouts) and `rpc` (requests over
channels) are the only modules that move bytes. May import `tree`, `engine`, `_os` and errors.
"""
