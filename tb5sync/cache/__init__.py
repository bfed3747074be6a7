"""The HTTP build cache ccache and Bazel speak, over the artifact store.

`httpcache` (aiohttp server: routing, GET/PUT/HEAD, auth, quota, metrics), `admission` (its connection
rules: per-address connection cap, request-head deadline) and `reapi` (the
Remote Execution API ActionResult reader, protobuf wire format). May import `store` and below.
"""
