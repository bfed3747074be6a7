"""The HTTP build cache ccache and Bazel speak, over the artifact store.

`httpcache` (aiohttp server: routing, GET/PUT/HEAD, auth, quota, metrics) and `reapi` (the
Remote Execution API ActionResult reader, protobuf wire format). May import `store` and below.
"""
