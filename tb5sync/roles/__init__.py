"""Roles split as in rsync: sender, generator, receiver, and the destination they write.

`sender` answers listing and chunk requests; `generator` lists and diffs; `receiver` plans and
orchestrates small files; `largefile` fetches and commits one large file; `inodes` makes hard
links; `destination` is every write under the destination's jail. The same code runs in process
or over a socket: roles meet sockets only through `tb5sync.remote.links` (they import no
`transport`, `rpc` or `links`). May import `wire` messages, `tree`, `engine`, `_os`.
"""
