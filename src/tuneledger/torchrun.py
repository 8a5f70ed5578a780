"""torchrun, with the rendezvous store of a single-node run listening on loopback only.

    python -m tuneledger.torchrun [torchrun arguments]

torchrun's agent hosts a TCPStore on `--master-port` that every rank reads and writes: whoever
can connect to it can join or disturb the job. Its server binds every interface (`*:PORT`, IPv4
and IPv6) whatever `--master-addr` says, on torch 2.5.1 and later alike, and torchrun has no
option or environment variable to change that. TCPStore does take an already-listening socket
(`master_listen_fd`; the libuv backend refuses one, so this server uses the classic backend), so
when the rendezvous address is a loopback one, this wrapper binds the socket to that address itself
and hands it over. Other addresses (multi-node) are left as torchrun makes them.

The ranks' own sockets are pinned by the launcher's environment (launch.py): GLOO_SOCKET_IFNAME
and NCCL_SOCKET_IFNAME = lo for a single-node run.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from typing import Any


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def loopback_listener(host: str, port: int) -> int:
    """A socket listening on (host, port), detached: its fd now belongs to the TCPStore server."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1" if host == "localhost" else host, port))
    s.listen(512)
    return s.detach()  # Python must never close it: the store's daemon thread polls it until exit


def patch_static_rendezvous() -> None:
    """Make torchrun's static rendezvous (the one `--master-addr/--master-port` selects) host its
    store on a loopback-bound socket when the address is loopback."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous

    def store(host: str, port: int, world_size: Any = None, is_master: bool = False, *args: Any, **kw: Any) -> TCPStore:
        if is_master and is_loopback(host):
            fd = loopback_listener(host, port)
            try:
                return TCPStore(host, port, world_size, is_master, *args, **kw, master_listen_fd=fd, use_libuv=False)
            except (TypeError, NotImplementedError, RuntimeError) as e:  # a torch without the classic backend
                os.close(fd)
                print(f"WARNING: the rendezvous store could not be bound to {host} ({type(e).__name__}: {e}); it "
                      f"listens on every interface, port {port}", file=sys.stderr, flush=True)
        return TCPStore(host, port, world_size, is_master, *args, **kw)

    static_tcp_rendezvous.TCPStore = store


def main(argv: list[str]) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    patch_static_rendezvous()
    try:
        torchrun(argv)
    except ChildFailedError as e:
        # torchrun's own traceback says only where in torchrun it raised; its table of the failed
        # ranks (exit code or signal, which rank first) is what the user and the launcher read.
        print(f"torchrun: {type(e).__name__}:{e}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
