"""The build cache ccache and Bazel speak (HTTP, and the Remote Execution API over gRPC), over the artifact store.

`httpcache` (aiohttp server: routing, GET/PUT/HEAD, auth, quota, metrics), `admission` (its connection
rules: per-address connection cap, request-head deadline) and `reapi` (the
Remote Execution API ActionResult reader, protobuf wire format); `grpccache` (the REAPI's cache services over
gRPC beside an HttpCache, its stubs generated into `_reapi_pb`; imported only by the command, lazily).
May import `store` and below.
"""
