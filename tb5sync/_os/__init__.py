"""Ground: portable OS calls and the path jail.

Paths under a root (`paths.Jail`, temp names), write-all loops and the rate limit (`io`),
buffer pools, holes (`sparse`), xattrs and rsync's unsafe-symlink rule (`fsmeta`), interface
names and IPv6 zones (`netif`), a directory's disk test (`diskbench`). Each Linux-only call has
its portable twin chosen at run time. Imports only :mod:`tb5sync.errors` and the standard library.
"""
