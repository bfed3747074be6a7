"""Ref rules of the artifact store: pins protect from rm, refs cannot nest, put of the same content is a
no-op, and the CLI's messages and exit codes for them.

Expected values: the README's promises (a pin protects a ref from eviction, gc and rm; exit 2 for usage
errors with the flag that overrides), git's ref rule (``a`` and ``a/b`` cannot coexist), and the bytes of
the source trees read back through fsspec's LocalFileSystem. Servers run on 127.0.0.1 port 0 and stop
in teardown.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
from typing import Any

import fsspec
import pytest

from tb5sync.cli.command import main
from tb5sync.errors import DestinationError, RefExistsError, RefNotFoundError, RefPinnedError
from tb5sync.store import Store
from tb5sync.store.objstore import ObjectStore
from tb5sync.remote.storeclient import pull_ref, push_ref
from tb5sync.wire.urls import parse_url


def write(path: str, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


@pytest.fixture(params=["dir", "object"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    """A directory store, and an object store (fsspec ``memory://``)."""
    if request.param == "dir":
        st: Any = Store(tmp_path / "st")
    else:
        st = ObjectStore(f"memory://tb5-{secrets.token_hex(4)}", cache=str(tmp_path / "cache"))
    try:
        yield st
    finally:
        st.close()


def cli(tmp_path: Any, *args: str) -> int:
    return main(["store", "--store", str(tmp_path / "cli_store"), *args])


# ---- 1. a pin protects a ref from rm -----------------------------------------------------------


def test_rm_of_a_pinned_ref_is_refused_until_unpinned_or_forced(tmp_path: Any, store: Any) -> None:
    write(str(tmp_path / "v" / "a"), b"a")
    store.put("builds/main/1", str(tmp_path / "v"))
    store.put("builds/main/2", str(tmp_path / "v"))
    store.pin("builds/main/1")
    store.pin("builds/main/2")
    with pytest.raises(RefPinnedError, match=r"pinned: run 'tb5sync store unpin builds/main/1' first, or rm --force"):
        store.rm("builds/main/1")
    assert store.ref("builds/main/1").pinned  # still there, still pinned
    store.pin("builds/main/1", False)
    store.rm("builds/main/1")
    store.rm("builds/main/2", force=True)
    assert store.refs("builds/") == []


def test_cli_rm_pinned_exit_2_one_line_naming_unpin(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    write(str(tmp_path / "v" / "a"), b"a")
    assert cli(tmp_path, "put", "builds/main/1", str(tmp_path / "v")) == 0
    assert cli(tmp_path, "pin", "builds/main/1") == 0
    capsys.readouterr()
    assert cli(tmp_path, "put", "builds/main/0", str(tmp_path / "v")) == 0
    capsys.readouterr()
    assert cli(tmp_path, "rm", "builds/main/0", "builds/main/1") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "store unpin builds/main/1" in err and "--force" in err
    assert cli(tmp_path, "ls", "--json") == 0  # a pinned ref among them: none removed
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == ["builds/main/0", "builds/main/1"]
    assert cli(tmp_path, "rm", "builds/main/0") == 0
    assert cli(tmp_path, "rm", "--force", "builds/main/1") == 0
    assert cli(tmp_path, "ls", "--json") == 0
    assert json.loads(capsys.readouterr().out) == []


def test_every_store_subcommand_has_a_help_line(capsys: pytest.CaptureFixture[str]) -> None:
    import tb5sync.cli.command as climod

    parser = climod.build_parser()
    store = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["store"]
    subs = next(a for a in store._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in subs._choices_actions}
    assert set(helps) == set(subs.choices) and len(helps) >= 15
    for name, p in subs.choices.items():
        assert helps[name] and p.description, name
        with pytest.raises(SystemExit):
            main(["store", name, "--help"])
        out = capsys.readouterr().out
        assert p.description in " ".join(out.split()), name


# ---- 2. refs cannot nest ------------------------------------------------------------------------


def test_a_ref_cannot_nest_inside_another_or_around_one(tmp_path: Any, store: Any) -> None:
    write(str(tmp_path / "v" / "sub" / "b.txt"), b"outer b")
    write(str(tmp_path / "w" / "b.txt"), b"inner b")
    store.put("builds/main/2", str(tmp_path / "v"))
    for inner in ("builds/main/2/sub", "builds/main/2/sub/deeper"):
        with pytest.raises(RefExistsError, match=r"cannot coexist with ref 'builds/main/2'.*path prefix"):
            store.put(inner, str(tmp_path / "w"))
    for outer in ("builds", "builds/main"):
        with pytest.raises(RefExistsError, match=r"cannot coexist with ref 'builds/main/2'"):
            store.put(outer, str(tmp_path / "w"))
    store.put("builds/main/20", str(tmp_path / "w"))  # a name prefix but not a path prefix: fine
    store.put("builds/main/2x/sub", str(tmp_path / "w"))
    assert [r.name for r in store.refs()] == ["builds/main/2", "builds/main/20", "builds/main/2x/sub"]


def test_pull_and_push_refuse_nesting_before_moving_chunks(tmp_path: Any, node: Any) -> None:
    write(str(tmp_path / "v" / "sub" / "b.txt"), b"outer b")
    write(str(tmp_path / "w" / "b.txt"), b"inner b")
    r = parse_url(f"tb5://127.0.0.1:{node.port}")
    with Store(tmp_path / "a") as a:
        a.put("builds/main/2", str(tmp_path / "v"))
        a.put("other", str(tmp_path / "w"))
        push_ref(a, "builds/main/2", r)
        with pytest.raises(RefExistsError, match=r"cannot coexist with ref 'builds/main/2' in 127\.0\.0\.1:"):
            push_ref(a, "other", r, as_name="builds/main/2/sub")
        with pytest.raises(RefExistsError, match=r"cannot coexist with ref 'builds/main/2' in 127\.0\.0\.1:"):
            push_ref(a, "other", r, as_name="builds")
        push_ref(a, "other", r)
        with pytest.raises(RefExistsError, match=r"cannot coexist with ref 'builds/main/2' in store"):
            pull_ref(a, "other", r, as_name="builds/main/2/sub")
        assert [x.name for x in a.refs()] == ["builds/main/2", "other"]
    # the path view shows the outer ref's file, as the source tree has it (read with LocalFileSystem)
    fs = fsspec.filesystem("tb5store", host="127.0.0.1", port=node.port, skip_instance_cache=True)
    want = fsspec.filesystem("file").cat_file(str(tmp_path / "v" / "sub" / "b.txt"))
    try:
        assert fs.cat_file("tb5store://127.0.0.1/builds/main/2/sub/b.txt") == want
    finally:
        fs.close()


def test_commit_refuses_nesting_too(tmp_path: Any) -> None:
    """The check at commit (a server's, a tier's write-through) holds without the early one in put."""
    write(str(tmp_path / "v" / "a"), b"a")
    with Store(tmp_path / "st") as st:
        st.put("x/y", str(tmp_path / "v"))
        info = st.ref("x/y")
        lease = st.lease()
        with pytest.raises(RefExistsError, match="cannot coexist"):
            st.commit_ref(lease, "x", info.manifest, list(info.mchunks), st.manifest(info))
        lease.release()


# ---- 3. put of the same content is a no-op ------------------------------------------------------


def test_put_same_content_is_a_noop_other_content_names_force(tmp_path: Any, store: Any) -> None:
    write(str(tmp_path / "v" / "a"), b"a")
    first = store.put("r/1", str(tmp_path / "v"))
    assert store.put("r/1", str(tmp_path / "v")) == first
    write(str(tmp_path / "v" / "a"), b"changed")
    with pytest.raises(RefExistsError, match=r"already exists .*other content \(--force replaces it\)"):
        store.put("r/1", str(tmp_path / "v"))
    assert store.ref("r/1") == first
    assert store.put("r/1", str(tmp_path / "v"), replace=True).manifest != first.manifest


def test_cli_put_twice(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    write(str(tmp_path / "v" / "a"), b"a")
    assert cli(tmp_path, "put", "r/1", str(tmp_path / "v")) == 0
    capsys.readouterr()
    assert cli(tmp_path, "put", "r/1", str(tmp_path / "v")) == 0
    assert capsys.readouterr().out.strip() == "r/1: same content already; nothing to do"
    assert cli(tmp_path, "put", "--json", "r/1", str(tmp_path / "v")) == 0
    assert json.loads(capsys.readouterr().out)["unchanged"] is True
    write(str(tmp_path / "v" / "a"), b"b")
    assert cli(tmp_path, "put", "r/1", str(tmp_path / "v")) == 2
    err = capsys.readouterr().err
    assert "--force" in err and len(err.strip().splitlines()) == 1


# ---- 6. messages --------------------------------------------------------------------------------


def test_put_counts_files_in_english(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    write(str(tmp_path / "one"), b"x")
    write(str(tmp_path / "two" / "a"), b"a")
    write(str(tmp_path / "two" / "b"), b"b")
    assert cli(tmp_path, "put", "one", str(tmp_path / "one")) == 0
    assert cli(tmp_path, "put", "two", str(tmp_path / "two")) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("one: 1 file, ") and out[1].startswith("two: 2 files, ")


def test_get_onto_an_existing_destination_is_a_usage_error(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    write(str(tmp_path / "v" / "a"), b"a")
    write(str(tmp_path / "dest" / "keep"), b"keep")
    assert cli(tmp_path, "put", "r", str(tmp_path / "v")) == 0
    capsys.readouterr()
    assert cli(tmp_path, "get", "r", str(tmp_path / "dest")) == 2
    assert "--force" in capsys.readouterr().err
    assert os.listdir(tmp_path / "dest") == ["keep"]
    with Store(tmp_path / "cli_store") as st, pytest.raises(DestinationError):  # the class callers catch still
        st.get("r", str(tmp_path / "dest"))
    assert cli(tmp_path, "get", "--force", "r", str(tmp_path / "dest")) == 0
    assert os.listdir(tmp_path / "dest") == ["a"]


def test_pull_of_a_missing_ref_names_the_server(tmp_path: Any, node: Any, capsys: pytest.CaptureFixture[str]) -> None:
    with Store(tmp_path / "a") as a, pytest.raises(RefNotFoundError) as ei:
        pull_ref(a, "nope", parse_url(f"tb5://127.0.0.1:{node.port}"))
    assert str(ei.value) == f"no ref 'nope' on 127.0.0.1:{node.port}"
    assert cli(tmp_path, "pull", "nope", f"tb5://127.0.0.1:{node.port}") == RefNotFoundError.exit_code
    err = capsys.readouterr().err
    assert f"127.0.0.1:{node.port}" in err and "<store>" not in err


class _Store:
    url = "s3://tb5/builds"
    timeout = 6.0


@pytest.mark.parametrize(("name", "text", "hint"), [
    # a timeout whose object key holds "403" inside a digest (writer-...ab4035...) is a timeout
    ("ReadTimeoutError", 'Read timeout on endpoint URL: "http://127.0.0.1:50403/tb5/builds/locks/'
                         'writer-8b4a4b652ed4a0ab4035461790c2f20d"', "--timeout S"),
    ("ReadTimeoutError", 'Read timeout on endpoint URL: "http://127.0.0.1:9000/forbidden/unauthorized-403"', "--timeout S"),
    ("TimeoutError", "", "--timeout S"),
    ("ClientError", "An error occurred (403) when calling the PutObject operation: Forbidden", "AWS_ACCESS_KEY_ID"),
    ("ClientError", "An error occurred (SignatureDoesNotMatch) when calling the ListObjectsV2 operation", "AWS_ACCESS_KEY_ID"),
    ("NoCredentialsError", "Unable to locate credentials", "AWS_ACCESS_KEY_ID"),
    ("ClientError", "An error occurred (NoSuchBucket) when calling the ListObjectsV2 operation", "check the bucket"),
    ("EndpointConnectionError", 'Could not connect to the endpoint URL: "http://127.0.0.1:1/tb5"', "cannot reach"),
])
def test_an_object_store_error_gets_the_hint_of_its_cause_not_of_names_in_it(name: str, text: str, hint: str) -> None:
    """The hint is chosen from the error's own words: the endpoint URL and object keys in the message
    (ports, hex digests, a bucket called ``forbidden``) never pick it."""
    from tb5sync.store.objstore import describe_error

    exc = type(name, (Exception,), {})(text)
    msg = str(describe_error(_Store(), "put", exc))
    assert msg.startswith(f"s3://tb5/builds: put failed: {name}:"), msg
    assert hint in msg, msg
    others = {"--timeout S", "AWS_ACCESS_KEY_ID", "check the bucket", "cannot reach"} - {hint}
    assert not any(o in msg for o in others), msg
