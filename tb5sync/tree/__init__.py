"""One tree: entries, excludes, the scan, the sync plan, the per-tree state, the options.

`entry.Entry` (one manifest line), `excludes` (rsync's rules), `scan` (listing, quick check),
`plan` (diff into a plan), `state` (SQLite scan cache and chunk index), `options`
(SyncOptions/SyncStats), `quota` (a session's write limits). Knows no sockets; may import
`engine`, `_os` and errors.
"""
