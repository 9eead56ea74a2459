"""SystemdNotifier against fake notify sockets (a bound AF_UNIX datagram socket plays systemd)."""

from __future__ import annotations

import os
import socket
import struct
import tempfile
import time
import uuid
from collections.abc import Iterator

import anyio
import pytest

from pagedserve.sidecar.sd_notify import SystemdNotifier, watchdog_loop


def _receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    # What systemd does: ask the kernel for the sender's credentials (that is how NotifyAccess=main
    # tells the main process from its children).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.settimeout(2.0)
    return sock


@pytest.fixture
def path_socket() -> Iterator[tuple[str, socket.socket]]:
    # A short directory of our own: AF_UNIX paths are limited to 107 bytes, pytest's tmp_path may not be.
    with tempfile.TemporaryDirectory(prefix="sdn-") as d:
        address = os.path.join(d, "notify")
        with _receiver(address) as sock:
            yield address, sock


@pytest.fixture
def abstract_socket() -> Iterator[tuple[str, socket.socket]]:
    name = f"pagedserve-test-{uuid.uuid4().hex}"
    with _receiver("\0" + name) as sock:
        yield "@" + name, sock


def _recv(sock: socket.socket) -> str:
    return sock.recv(4096).decode("utf-8")


def _drain(sock: socket.socket) -> list[str]:
    sock.setblocking(False)
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode("utf-8"))
        except BlockingIOError:
            return out


def test_messages_reach_a_filesystem_socket(path_socket):
    address, sock = path_socket
    n = SystemdNotifier({"NOTIFY_SOCKET": address})
    assert n.enabled
    assert n.ready()
    assert _recv(sock) == "READY=1"
    assert n.status("serving 3 requests")
    assert _recv(sock) == "STATUS=serving 3 requests"
    assert n.watchdog()
    assert _recv(sock) == "WATCHDOG=1"
    assert n.stopping()
    assert _recv(sock) == "STOPPING=1"
    assert n.notify("STATUS=a\nWATCHDOG=1")
    assert _recv(sock) == "STATUS=a\nWATCHDOG=1"


def test_messages_reach_an_abstract_socket(abstract_socket):
    address, sock = abstract_socket
    n = SystemdNotifier({"NOTIFY_SOCKET": address})
    assert n.ready(status="model loaded")
    assert _recv(sock) == "READY=1\nSTATUS=model loaded"
    assert n.watchdog()
    assert _recv(sock) == "WATCHDOG=1"
    assert n.stopping(status="draining 2 requests")
    assert _recv(sock) == "STOPPING=1\nSTATUS=draining 2 requests"


def test_reads_notify_socket_from_os_environ(path_socket, monkeypatch):
    address, sock = path_socket
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    assert SystemdNotifier().ready()
    assert _recv(sock) == "READY=1"


def test_kernel_reports_our_pid_as_sender(path_socket):
    """NotifyAccess=main only accepts datagrams whose SCM_CREDENTIALS pid is the main pid: ours."""
    address, sock = path_socket
    assert SystemdNotifier({"NOTIFY_SOCKET": address}).ready()
    data, ancdata, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(struct.calcsize("iII")))
    assert data == b"READY=1"
    creds = [d for level, kind, d in ancdata if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS]
    assert len(creds) == 1
    pid, uid, gid = struct.unpack("iII", creds[0][: struct.calcsize("iII")])
    assert (pid, uid, gid) == (os.getpid(), os.getuid(), os.getgid())


def test_status_is_kept_on_one_line(path_socket):
    address, sock = path_socket
    n = SystemdNotifier({"NOTIFY_SOCKET": address})
    assert n.status("line one\nREADY=1")
    assert _recv(sock) == "STATUS=line one READY=1"


def test_extend_timeout(path_socket):
    address, sock = path_socket
    n = SystemdNotifier({"NOTIFY_SOCKET": address})
    assert n.extend_timeout(90)
    assert _recv(sock) == "EXTEND_TIMEOUT_USEC=90000000"
    with pytest.raises(ValueError, match="extend_timeout seconds"):
        n.extend_timeout(0)


@pytest.mark.parametrize("env", [{}, {"NOTIFY_SOCKET": ""}, {"NOTIFY_SOCKET": "relative/notify"},
                                 {"NOTIFY_SOCKET": "@"}, {"NOTIFY_SOCKET": "vsock:2:1234"}])
def test_without_a_usable_socket_every_call_is_a_no_op(env):
    n = SystemdNotifier(env)
    assert not n.enabled
    assert n.address is None
    assert n.ready() is False
    assert n.status("x") is False
    assert n.stopping() is False
    assert n.watchdog() is False
    assert n.notify("READY=1") is False


def test_unset_os_environ_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    n = SystemdNotifier()
    assert n.ready() is False
    assert n.watchdog_interval() is None


def test_socket_errors_return_false_instead_of_raising(tmp_path, path_socket):
    gone = SystemdNotifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    assert gone.enabled
    assert gone.ready() is False  # ENOENT
    address, _ = path_socket
    assert SystemdNotifier({"NOTIFY_SOCKET": address}).notify("") is False
    # A datagram larger than the socket can carry (EMSGSIZE) is also swallowed.
    assert SystemdNotifier({"NOTIFY_SOCKET": address}).status("x" * (1 << 23)) is False


def test_watchdog_interval_is_half_of_watchdog_usec():
    assert SystemdNotifier({"WATCHDOG_USEC": "30000000"}).watchdog_interval() == 15.0
    assert SystemdNotifier({"WATCHDOG_USEC": "1000"}).watchdog_interval() == pytest.approx(0.0005)
    pid = str(os.getpid())
    assert SystemdNotifier({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": pid}).watchdog_interval() == 15.0


@pytest.mark.parametrize("env", [
    {},
    {"WATCHDOG_USEC": "0"},
    {"WATCHDOG_USEC": "-5"},
    {"WATCHDOG_USEC": "thirty"},
    {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)},  # meant for another process
    {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "not-a-pid"},
])
def test_no_watchdog_interval(env):
    assert SystemdNotifier(env).watchdog_interval() is None


def test_watchdog_pid_is_compared_at_call_time(monkeypatch):
    """A forked child inherits the notifier but not the duty to ping."""
    n = SystemdNotifier({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())})
    assert n.watchdog_interval() == 15.0
    monkeypatch.setattr(os, "getpid", lambda: 1)
    assert n.watchdog_interval() is None


def test_watchdog_loop_pings_until_cancelled(path_socket):
    address, sock = path_socket
    # WATCHDOG_USEC = 100 ms -> a ping every 50 ms; for 0.2 s that is ~5 pings, fewer than the
    # receiver's queue holds (net.unix.max_dgram_qlen may be as low as 10), so no send ever waits.
    n = SystemdNotifier({"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "100000"})

    async def main() -> float:
        with anyio.move_on_after(0.2):
            await watchdog_loop(n)
        return time.monotonic()

    start = time.monotonic()
    end = anyio.run(main)
    assert 0.15 <= end - start < 1.5  # it ran until cancelled, not less
    pings = _drain(sock)
    assert len(pings) >= 2
    assert set(pings) == {"WATCHDOG=1"}


def test_a_full_receiver_queue_costs_at_most_send_timeout(path_socket):
    """A systemd that does not read must not hang the server: the send gives up and returns False."""
    address, sock = path_socket
    n = SystemdNotifier({"NOTIFY_SOCKET": address}, send_timeout=0.05)
    sent = 0
    while n.watchdog():  # nobody reads, so the queue fills up
        sent += 1
        assert sent < 100_000, "the receiver's queue never filled"
    start = time.monotonic()
    assert n.watchdog() is False
    assert time.monotonic() - start < 1.0
    assert sent >= 1
    with pytest.raises(ValueError, match="send_timeout"):
        SystemdNotifier({}, send_timeout=0)


def test_watchdog_loop_returns_when_no_watchdog_is_configured(path_socket):
    address, sock = path_socket
    n = SystemdNotifier({"NOTIFY_SOCKET": address})

    async def main() -> bool:
        with anyio.fail_after(1.0):
            await watchdog_loop(n)
        return True

    assert anyio.run(main)
    assert _drain(sock) == []
