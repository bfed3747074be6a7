"""The Python API's entry points: :func:`tb5sync.sync` (rsync-like) and `tb5sync bench`.

`sync` (local, push and pull over links), `bench` (link, disks, CPU, push/pull, verdict).
May import `remote`, `roles` and below; re-exported from :mod:`tb5sync`.
"""
