"""Replies settled on an event loop in batches (:class:`tb5sync.wire.rpc.LoopReplies`), the path
of every async tb5:// call: each future gets its own reply, a cancelled one is skipped, a closed
loop is no error for the reader thread; and many reads in flight at once (``asyncio.gather`` of
``_cat_file``, some cancelled) give what fsspec's LocalFileSystem reads from the same file."""

from __future__ import annotations

import asyncio
import os
import random
import threading
from typing import Any

import fsspec.asyn
import pytest
from fsspec.implementations.local import LocalFileSystem

from conftest import start_server
from conftest import tb5fs as tb5
from tb5sync.errors import Tb5syncError
from tb5sync.wire.rpc import LoopReplies

pytestmark = pytest.mark.timeout(60)


def test_each_future_gets_its_own_reply_from_other_threads() -> None:
    async def main() -> list[Any]:
        replies = LoopReplies(asyncio.get_running_loop())
        pairs = [replies.future() for _ in range(500)]

        def settle(part: int) -> None:
            for i in range(part, len(pairs), 4):
                if i % 7 == 0:
                    pairs[i][1].set_exception(ValueError(i))
                else:
                    pairs[i][1].set_result(i)

        threads = [threading.Thread(target=settle, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        out = await asyncio.gather(*[f for f, _ in pairs], return_exceptions=True)
        for t in threads:
            t.join(10)
        return out

    out = asyncio.run(main())
    for i, r in enumerate(out):
        if i % 7 == 0:
            assert isinstance(r, ValueError) and r.args == (i,)
        else:
            assert r == i


def test_a_cancelled_future_is_skipped_and_the_others_still_settle() -> None:
    async def main() -> tuple[bool, Any]:
        replies = LoopReplies(asyncio.get_running_loop())
        (a, sa), (b, sb) = replies.future(), replies.future()
        a.cancel()
        threading.Thread(target=lambda: (sa.set_result(1), sb.set_result(2))).start()
        return a.cancelled(), await asyncio.wait_for(b, 10)

    assert asyncio.run(main()) == (True, 2)


def test_a_reply_after_the_loop_closed_is_dropped_quietly() -> None:
    loop = asyncio.new_event_loop()
    replies = LoopReplies(loop)
    fut, settle = replies.future()
    loop.close()
    settle.set_result(1)  # no exception on the reader thread
    settle.set_exception(ValueError("late"))


def test_many_gathered_reads_some_cancelled_equal_local_ones(tmp_path: Any) -> None:
    data = random.Random(3).randbytes(1 << 20)
    (tmp_path / "big.bin").write_bytes(data)
    live = start_server(str(tmp_path))
    fs = tb5(live, streams=3)
    local = LocalFileSystem()
    path = os.path.join(str(tmp_path), "big.bin")
    rnd = random.Random(5)
    offs = [rnd.randrange(0, len(data) - 4096) for _ in range(3000)]

    async def main() -> tuple[list[Any], Any]:
        tasks = [asyncio.ensure_future(fs._cat_file("big.bin", o, o + 4096)) for o in offs]
        await asyncio.sleep(0)  # every task sent its request and waits for the reply
        for t in tasks[::10]:
            t.cancel()
        got = await asyncio.gather(*tasks, return_exceptions=True)
        missing = await asyncio.gather(fs._cat_file("nothing-here"), return_exceptions=True)
        return got, missing[0]

    try:
        got, missing = fsspec.asyn.sync(fs.loop, main)
        for i, (o, g) in enumerate(zip(offs, got)):
            if i % 10 == 0:
                assert isinstance(g, asyncio.CancelledError)
            else:
                assert g == local.cat_file(path, o, o + 4096)
        assert isinstance(missing, FileNotFoundError) and isinstance(missing, Tb5syncError)
        # the link still serves after the cancelled requests' replies were dropped
        assert fs.cat_file("big.bin", 10, 20) == data[10:20]
    finally:
        fs._holder.close()
        live.server.stop()


class _Echo:
    def echo(self, x: int, pad: bytes = b"") -> dict[str, Any]:
        return {"x": x, "n": len(pad)}


def _pair() -> tuple[Any, Any, threading.Thread]:
    import socket

    from tb5sync.wire.rpc import serve
    from tb5sync.wire.transport import Channel

    a, b = socket.socketpair()
    server = Channel(b)
    t = threading.Thread(target=serve, args=(server, _Echo(), frozenset({"echo"})), daemon=True)
    t.start()
    return Channel(a), server, t


def test_deferred_requests_go_out_together_at_flush_and_each_gets_its_reply() -> None:
    from tb5sync.wire.rpc import Requester

    client, server, t = _pair()
    req = Requester([client])
    try:
        sent0 = client.bytes_sent
        futs = [req.submit("echo", {"x": i}, defer=True) for i in range(300)]
        assert client.bytes_sent == sent0  # nothing sent before the flush
        req.flush()
        assert [f.result(10)["x"] for f in futs] == list(range(300))
        req.flush()  # nothing held: nothing sent
    finally:
        req.close()
        t.join(10)
        server.close()


def test_a_flush_on_a_broken_connection_fails_the_deferred_requests_and_does_not_raise() -> None:
    from tb5sync.errors import ConnectError
    from tb5sync.wire.rpc import Requester

    client, server, t = _pair()
    req = Requester([client])
    try:
        futs = [req.submit("echo", {"x": i}, defer=True) for i in range(3)]
        client.sock.shutdown(__import__("socket").SHUT_WR)  # our sending side is gone
        req.flush()
        for f in futs:
            with pytest.raises(ConnectError):
                f.result(10)
    finally:
        req.close(bye=False)
        server.close()
        t.join(10)


def test_deferred_large_requests_are_sent_whole() -> None:
    from tb5sync.wire.rpc import Requester

    client, server, t = _pair()
    req = Requester([client])
    try:
        big = 700_000  # together past 1 MiB: sent as separate parts, not joined
        futs = [req.submit("echo", {"x": i, "pad": b"p" * big}, defer=True) for i in range(3)]
        futs += [req.submit("echo", {"x": 9}, defer=True)]
        req.flush()
        assert [(f.result(10)["x"], f.result(10)["n"]) for f in futs] == [(0, big), (1, big), (2, big), (9, 0)]
    finally:
        req.close()
        t.join(10)
        server.close()
