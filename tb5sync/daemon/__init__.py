"""The daemon: `tb5sync serve`.

`server` (connections, admission, TLS, the OPEN dispatch), over its sessions: `sessions` (pull,
push, their joined streams, ls), `benchops` (ping, the link and disk tests) and `services` (fs and
store sessions); below them `admission` (rules a stranger meets before authentication) and `fsops`
(the server side of a tb5:// fs session, every path through the jail). May import `remote`
(tiers), `roles`, `store` and below.
"""
