"""The daemon: `tb5sync serve`.

`server` (connections, sessions, caps, timeouts, TLS), `admission` (rules a stranger meets
before authentication), `fsops` (the server side of a tb5:// fs session, every path through the
jail). May import `remote` (tiers), `roles`, `store` and below.
"""
