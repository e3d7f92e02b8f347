"""A kvrescue-local server run in-process on a loopback port, for the tests and perf/serve_perf.py."""

from __future__ import annotations

import re
import threading
import time

import httpx

from kvrescue_local.cli.serve import build_served, listening_socket, serve
from kvrescue_local.serve.app import Server, create_app


class LoopbackServer:
    """`kvrescue-local serve ARGS` on 127.0.0.1 in a thread; the engine starts with it unless start_engine=False."""

    def __init__(self, args: list[str], start_engine: bool = True) -> None:
        self.served = build_served(serve.make_context("serve", list(args)).params)
        self.sock = listening_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = Server(self.served, create_app(self.served))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        if start_engine:
            self.served.engine.start()
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics").text
        return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))

    def wait_idle(self, limit_s: float = 60.0) -> None:
        """Until no request is in flight or queued (bounded: a slot that is never freed fails the caller)."""
        deadline = time.monotonic() + limit_s
        while self.metric("kvrescue_requests_in_flight") or self.metric("kvrescue_requests_queued"):
            if time.monotonic() > deadline:
                raise AssertionError("requests still held by the engine")
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.served.engine.close()
        self.sock.close()
