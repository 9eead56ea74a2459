"""Who is calling on the unix socket: the peer's credentials (SO_PEERCRED), read by the server.

grpcio gives a servicer no file descriptor and no credentials for a unix-socket call: context.peer() is
just "unix:" and auth_context() holds only the transport's security type, local credentials included
(gRPC core never calls SO_PEERCRED: grpc/grpc#15511, #28755). So with a tenants file the public socket
is ours:

    client --unix--> public socket (asyncio, mode 0660)   getsockopt(SO_PEERCRED) -> (pid, uid, gid) -> tenant
                      |  relay: a socket bound to the abstract name "pagedserve-peer/<server pid>/<random>"
                      v
                     gRPC's private socket (a 0700 folder beside the public one: only the server reaches it)
                      -> context.peer() == "unix-abstract:pagedserve-peer/<pid>/<random>" -> this table -> tenant

The kernel vouches for the credentials (taken at connect time; the client claims nothing), and no other
process can reach the private socket, so no one can pose as a relayed peer. The cost is one copy of each
byte on the event loop (prompts and token streams, small beside a forward pass). Without a tenants file the
server binds gRPC on the public socket itself, as before.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import socket
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import structlog

log = structlog.get_logger("pagedserve.server")

PEER_PREFIX = "pagedserve-peer/"
_ABSTRACT = "unix-abstract:"
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_cred(sock: socket.socket) -> PeerCred:
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return PeerCred(pid, uid, gid)


def private_socket_path(public: str) -> str:
    """A fresh 0700 folder beside the public socket, and gRPC's socket in it."""
    folder = tempfile.mkdtemp(prefix=".pagedserve-", dir=str(Path(public).parent))
    return os.path.join(folder, "grpc.sock")


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, both: list) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        for w in both:  # one side gone: the connection is over
            w.close()


class PeerProxy:
    def __init__(self, public_path: str, private_path: str, identify: Callable[[PeerCred], str]) -> None:
        self.public_path = public_path
        self.private_path = private_path
        self.identify = identify
        self.peers: dict[str, tuple[PeerCred, str]] = {}  # abstract name -> (credentials, tenant)
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._handle, path=self.public_path)

    def lookup(self, peer: str) -> tuple[PeerCred, str] | None:
        """The credentials and tenant of a gRPC call's peer string; None for a call that did not come through here."""
        if not peer.startswith(_ABSTRACT + PEER_PREFIX):
            return None
        return self.peers.get(peer[len(_ABSTRACT):])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        name = f"{PEER_PREFIX}{os.getpid()}/{secrets.token_hex(8)}"
        out = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            cred = peer_cred(writer.get_extra_info("socket"))
            tenant = self.identify(cred)
            out.bind("\0" + name)
            out.setblocking(False)
            await asyncio.get_running_loop().sock_connect(out, self.private_path)
            self.peers[name] = (cred, tenant)
            log.debug("server.peer_connected", uid=cred.uid, gid=cred.gid, pid=cred.pid, tenant=tenant)
            r2, w2 = await asyncio.open_unix_connection(sock=out)
            both = [writer, w2]
            await asyncio.gather(_pipe(reader, w2, both), _pipe(r2, writer, both))
        except (ConnectionError, OSError) as e:
            log.warning("server.peer_relay_failed", error=repr(e))
            out.close()
            writer.close()
        finally:
            self.peers.pop(name, None)
            self._tasks.discard(task)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        shutil.rmtree(Path(self.private_path).parent, ignore_errors=True)
