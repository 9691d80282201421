"""The in-memory weight sync's rendezvous store: it listens on one address, and only a process
holding its token (a per-rendezvous secret) may use it.

    store = SecretStoreServer("10.0.0.1", timeout_s=600)   # trainer: listens on 10.0.0.1:<kernel's pick>
    group = ProcessGroupGloo(store.store, 0, world, timeout)   # its own rank uses the in-process store
    ... each worker (the token reached it in the keyed /init_weight_transfer_engine body):
    group = ProcessGroupGloo(SecretStoreClient(host, port, token, timeout_s), rank, world, timeout)
    store.close()                                          # once every worker has joined

Why not torch's TCPStore: its server takes any connection, and any client may list every key
(`list_keys`), read them and write them. A process that connects first can then read the
rank-address keys, or write one and so take a worker's rank and receive the broadcast weights
(a random key prefix does not help: `list_keys` shows it). Here a connection must open with the
token, compared in constant time, or it is closed unanswered (`refused` counts them); the token
goes only over the server's bearer-keyed HTTP.

Wire format: the token and a newline, then one JSON line per request ({"op", "key" | "keys",
"value" base64, ...}) and one JSON line per answer ({"value": ...} or {"error": ...}). The ops
are those a gloo rendezvous uses (set, get, wait) and the rest of torch's Store basics.

Cost: one thread per connection (one per worker) while the store lives, which is the rendezvous
only: nothing of the broadcast goes through it. Standard library and torch only: this module is
also imported by the vLLM server's workers (server_plugin/__init__.py).
"""
from __future__ import annotations

import base64
import datetime
import hmac
import json
import secrets
import socket
import threading

import torch.distributed as dist

TOKEN_TIMEOUT_S = 10.0  # a connection that sends no token within this is closed (no thread held)


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else bytes(data)).decode()


def _seconds(timeout) -> float:
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


class SecretStoreServer:
    """A HashStore served on `host` (port 0: the kernel's pick, kept from then on) to clients that
    open with `token` (a fresh random one per store)."""

    def __init__(self, host: str, timeout_s: float):
        self.token = secrets.token_hex(32)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.HashStore()
        self.store.set_timeout(self.timeout)
        self.refused = 0
        self._sock = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.host, self.port = self._sock.getsockname()[:2]
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="weight-store-accept").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="weight-store-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(TOKEN_TIMEOUT_S)
                f = conn.makefile("rwb")
                given = f.readline(len(self.token) + 2).strip()
                if not hmac.compare_digest(given, self.token.encode()):
                    with self._lock:
                        self.refused += 1
                    return
                conn.settimeout(None)  # a wait may block up to the store's timeout
                for line in f:
                    f.write(json.dumps(self._answer(json.loads(line))).encode() + b"\n")
                    f.flush()
            except (OSError, ValueError):
                return

    def _answer(self, req: dict) -> dict:
        op, s = req.get("op"), self.store
        try:
            if op == "set":
                s.set(req["key"], base64.b64decode(req["value"]))
                return {"value": None}
            if op == "get":
                return {"value": _b64(s.get(req["key"]))}
            if op == "wait":
                s.wait(req["keys"], datetime.timedelta(seconds=req.get("timeout_s", self.timeout.total_seconds())))
                return {"value": None}
            if op == "add":
                return {"value": s.add(req["key"], int(req["amount"]))}
            if op == "check":
                return {"value": s.check(req["keys"])}
            if op == "compare_set":
                return {"value": _b64(s.compare_set(req["key"], base64.b64decode(req["expected"]),
                                                    base64.b64decode(req["desired"])))}
            if op == "delete_key":
                return {"value": s.delete_key(req["key"])}
            if op == "num_keys":
                return {"value": s.num_keys()}
            return {"error": f"unknown op {op!r}"}
        except Exception as e:  # noqa: BLE001 - the client raises it (a timeout, mostly)
            return {"error": f"{type(e).__name__}: {e}"}

    def close(self) -> None:
        """Stop listening and drop the connections (the rendezvous is over)."""
        try:  # close() alone leaves the socket listening while the accept thread is inside accept()
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class SecretStoreClient(dist.Store):
    """A torch Store that is a SecretStoreServer reached with its token (one connection; the
    calls are serialised)."""

    def __init__(self, host: str, port: int, token: str, timeout_s: float):
        super().__init__()
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._sock.settimeout(timeout_s + 30.0)  # the server ends a wait first, with its own error
        self._f = self._sock.makefile("rwb")
        self._f.write(token.encode() + b"\n")
        self._f.flush()

    def _call(self, **req):
        with self._lock:
            try:
                self._f.write(json.dumps(req).encode() + b"\n")
                self._f.flush()
                line = self._f.readline()
            except ConnectionError:  # a refusal closes with our request unread: the kernel resets, not ends
                line = b""
        if not line:
            raise RuntimeError("the weight-transfer rendezvous store closed the connection (a wrong token, or the "
                               "trainer stopped the rendezvous)")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"weight-transfer rendezvous store: {out['error']}")
        return out["value"]

    def set(self, key, value):
        self._call(op="set", key=key, value=_b64(value))

    def get(self, key):
        return base64.b64decode(self._call(op="get", key=key))

    def wait(self, keys, timeout=None):
        self._call(op="wait", keys=list(keys), timeout_s=self.timeout_s if timeout is None else _seconds(timeout))

    def add(self, key, amount):
        return self._call(op="add", key=key, amount=int(amount))

    def check(self, keys):
        return self._call(op="check", keys=list(keys))

    def compare_set(self, key, expected, desired):
        return base64.b64decode(self._call(op="compare_set", key=key, expected=_b64(expected), desired=_b64(desired)))

    def delete_key(self, key):
        return self._call(op="delete_key", key=key)

    def num_keys(self):
        return self._call(op="num_keys")

    def close(self) -> None:
        self._sock.close()
