"""A real S3-compatible server for the tests: moto's standalone server on 127.0.0.1, reached over
HTTP by the same client code users run (obstore); a fresh bucket per test. boto3 (moto's own
dependency) is the independent client the tests read buckets with. `Outage` is a real TCP relay
in front of the server that a test can cut and restore, to stop the store mid-run without losing
its contents (moto keeps them in memory)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from harness.ports import free_port

try:
    import boto3
    import moto  # noqa: F401
    import obstore  # noqa: F401
except ImportError:  # pragma: no cover - the [test] extra installs them
    boto3 = None

KEY_ID, SECRET = "testing-key-id", "testing-secret-key-never-printed"


class MotoServer:
    def __init__(self, **env):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **env})
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("moto server did not start")

    def client(self):
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET,
                            region_name="us-east-1")

    def new_bucket(self) -> str:
        name = f"t-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """What a user sets to reach this server (no profile files)."""
        return {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": endpoint or self.endpoint, "AWS_CONFIG_FILE": os.devnull,
                "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def use_server(monkeypatch, env: dict[str, str]) -> dict[str, str]:
    """Point this process's S3 client at a test server for one test (`MotoServer.env`), with
    short retries so a refused connection fails fast."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("DFLASH_S3_RETRY_SECONDS", "3")
    return env


def objects(client, bucket: str, prefix: str = "") -> dict[str, bytes]:
    """Every object under prefix (relative keys), read with boto3."""
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            key = item["Key"]
            out[key[len(prefix):].lstrip("/")] = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    return out


def download(client, bucket: str, prefix: str, dest: Path) -> Path:
    """Copy a bucket prefix into a directory, object by object (what `aws s3 sync` does)."""
    for rel, data in objects(client, bucket, prefix).items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return dest


class Outage:
    """A TCP relay on its own port in front of `target_port`: `cut()` closes the listener and
    every open connection (the client sees connection refused / reset), `restore()` listens again."""

    def __init__(self, target_port: int):
        self.target_port, self.port = target_port, free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.listener: socket.socket | None = None
        self.conns: list[socket.socket] = []
        self.restore()

    def restore(self) -> None:
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", self.port))
        self.listener.listen(64)
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(1 << 16):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close alone does not
        except OSError:
            pass
        self.listener.close()
        for s in self.conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass
        self.conns = []


class ForgetfulRelay:
    """A real HTTP relay on its own port in front of an S3-compatible server that drops the
    request headers named in `drop` (by default `If-None-Match`, making the store behind it one
    that ignores create-if-absent, as s3rver 3.7 and some gateways do) and counts what it forwards:
    `requests` lists (method, path, whether the header was there). Chosen over installing s3rver
    from npm: no Node.js in the test environment, and the store behind it is the same moto server
    every other object-store test uses, so the only difference is the one under test."""

    def __init__(self, target_port: int, drop: tuple[str, ...] = ("if-none-match",)):
        import http.client
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        relay = self
        self.requests: list[tuple[str, str, bool]] = []
        self.lock = threading.Lock()
        hop = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes | None:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    parts = []
                    while (size := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else None

            def _forward(self):
                body = self._body()
                had = any(k.lower() in drop for k in self.headers)
                with relay.lock:
                    relay.requests.append((self.command, self.path, had))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in drop and k.lower() not in hop}
                if body is not None:
                    headers["Content-Length"] = str(len(body))
                upstream = http.client.HTTPConnection("127.0.0.1", target_port, timeout=60)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    data = response.read()
                finally:
                    upstream.close()
                self.send_response(response.status, response.reason)
                for k, v in response.getheaders():
                    if k.lower() not in hop and not (k.lower() == "content-length" and self.command != "HEAD"):
                        self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
