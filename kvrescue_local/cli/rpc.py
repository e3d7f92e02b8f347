"""`kvrescue-local rpc-server`: this machine's CPU backend served to other machines' `--rpc`."""

from __future__ import annotations

import threading

import click

from ..runtime.context import default_threads
from ..runtime.rpc import rpc_library, serve_backend
from .common import note


@click.command("rpc-server")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to listen on (0.0.0.0: every interface; the protocol has no authentication, serve only "
                   "a trusted network)")
@click.option("--port", default=50052, show_default=True, type=int)
@click.option("--threads", "-t", default=0, show_default=True, type=int,
              help="CPU threads for the layers served (0: KVRESCUE_THREADS, else physical cores - 1)")
def rpc_server(host, port, threads) -> None:
    """Serve this machine's CPU backend over llama.cpp's RPC protocol until Ctrl-C; other machines reach it with
    `--rpc HOST:PORT` on solve, bench and serve."""
    rpc_library()  # a build without the RPC backend is refused before anything is printed
    note(f"serving the CPU backend on {host}:{port} (llama.cpp RPC); Ctrl-C stops it")
    # the server call never returns: it runs in a daemon thread so that Ctrl-C reaches the main one
    thread = threading.Thread(target=serve_backend, args=(host, port, threads or default_threads()), daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.5)
    except KeyboardInterrupt:
        note("stopped")
    else:
        raise click.ClickException(f"the RPC server on {host}:{port} stopped: is the port free?")
