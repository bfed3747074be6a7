"""One connection to a server and what runs over it (the client side).

`client` (push, pull, ls, bench over one connection), `links` (the Link the roles talk to:
in process or over rpc), `storeclient` (store refs pushed and pulled, only missing chunks),
`fanout` (one ref from several sources at once), `tiers` (a local store as a read-through /
write-through cache of a shared one). May import `roles`, `store`, `wire` and below.
"""
