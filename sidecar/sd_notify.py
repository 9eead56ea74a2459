"""The sd_notify(3) protocol, written by hand: readiness, status and watchdog messages to systemd.

Under a `Type=notify` unit systemd passes $NOTIFY_SOCKET, the address of an AF_UNIX datagram socket,
and waits for the service to send "READY=1" before it counts the unit as started. Each message is one
datagram of newline-separated KEY=VALUE assignments. systemd learns the sender's PID from the kernel
(SO_PASSCRED on its end), which is how `NotifyAccess=main` rejects messages from child processes; the
sender attaches nothing.

The life of pagedserve under systemd:

    start ──> load + warm up ──> READY=1 ──> serve (STATUS=..., WATCHDOG=1 every WatchdogSec/2)
                                                │ SIGTERM
                                                v
                                             STOPPING=1 ──> drain ──> exit 0

systemd arms the watchdog timer only once READY=1 has arrived (the unit enters start-post/running),
and disarms it as soon as the unit starts stopping; loading time is bounded by TimeoutStartSec
instead. So `watchdog_loop` belongs after `ready()`.

Outside systemd (no $NOTIFY_SOCKET) every call is a no-op that returns False, so callers never need to
ask whether they run under systemd. Sending never raises: a lost status line must not take the server
down, and systemd may legitimately be gone (e.g. during shutdown).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import anyio

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"
WATCHDOG_USEC_ENV = "WATCHDOG_USEC"
WATCHDOG_PID_ENV = "WATCHDOG_PID"


def _parse_address(value: str | None) -> str | None:
    """$NOTIFY_SOCKET -> an address for socket.sendto, or None when notifications are off.

    "/run/systemd/notify" is a filesystem socket; "@name" is Linux's abstract namespace, which Python
    spells with a leading NUL byte. Anything else (unset, empty, relative, or systemd 254's "vsock:"
    form, which needs AF_VSOCK) disables notifications rather than guessing.
    """
    if not value:
        return None
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    return None


def _parse_positive_int(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        return None
    return n if n > 0 else None


class SystemdNotifier:
    """Sends sd_notify messages to the socket named by $NOTIFY_SOCKET at construction time.

    `environ` defaults to os.environ; tests pass a dict. `send_timeout` bounds how long one send may
    wait when the receiver's queue is full (a busy systemd): the sender is the server's event loop,
    which must not hang on a status line, yet READY=1 should survive a short hiccup.
    """

    def __init__(self, environ: Mapping[str, str] | None = None, send_timeout: float = 1.0) -> None:
        if not send_timeout > 0:
            raise ValueError(f"send_timeout must be > 0 seconds, got {send_timeout!r}")
        env = os.environ if environ is None else environ
        self.send_timeout = send_timeout
        self.address: str | None = _parse_address(env.get(NOTIFY_SOCKET_ENV))
        self._watchdog_usec: int | None = _parse_positive_int(env.get(WATCHDOG_USEC_ENV))
        # Kept raw: "unset" and "set to something that is not our PID" mean different things.
        self._watchdog_pid: str | None = env.get(WATCHDOG_PID_ENV)

    @property
    def enabled(self) -> bool:
        """True when there is a notify socket to talk to."""
        return self.address is not None

    def notify(self, state: str) -> bool:
        """Send one datagram (e.g. "READY=1" or "STATUS=loading\\nWATCHDOG=1").

        Returns True when the datagram was handed to the kernel, False when notifications are off,
        `state` is empty, the socket could not be reached, or its queue stayed full for
        `send_timeout` seconds. Never raises OSError.
        """
        if self.address is None or not state:
            return False
        try:
            # A fresh socket per message, as libsystemd does: nothing to go stale across a fork or a
            # restart of systemd, and messages are rare (startup, status changes, a ping per interval).
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(self.send_timeout)  # a full queue raises TimeoutError (an OSError)
                sock.sendto(state.encode("utf-8"), self.address)
            return True
        except OSError:
            return False

    def ready(self, status: str | None = None) -> bool:
        """READY=1: the model is loaded and warmed; systemd may now start units ordered after us."""
        return self.notify(_with_status("READY=1", status))

    def status(self, text: str) -> bool:
        """STATUS=<text>: the one-line status shown by `systemctl status`."""
        return self.notify(_with_status("", text))

    def stopping(self, status: str | None = None) -> bool:
        """STOPPING=1: we have begun draining; systemd shows the unit as deactivating."""
        return self.notify(_with_status("STOPPING=1", status))

    def watchdog(self) -> bool:
        """WATCHDOG=1: the keep-alive ping that resets systemd's WatchdogSec timer."""
        return self.notify("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        """EXTEND_TIMEOUT_USEC=: ask for `seconds` more of start-up (or stop) time from now on.

        For an unusually slow first load (a large GGUF being dequantized into the cache) when the
        unit's TimeoutStartSec would otherwise run out.
        """
        if seconds <= 0:
            raise ValueError(f"extend_timeout seconds must be > 0, got {seconds!r}")
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")

    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings: half of $WATCHDOG_USEC, as sd_watchdog_enabled(3) advises.

        None when systemd expects no pings from this process: $WATCHDOG_USEC unset or not a positive
        integer, or $WATCHDOG_PID set to another process (a child that inherited the environment).
        """
        if self._watchdog_usec is None:
            return None
        if self._watchdog_pid is not None and _parse_positive_int(self._watchdog_pid) != os.getpid():
            return None
        return self._watchdog_usec / 2 / 1_000_000


def _with_status(head: str, status: str | None) -> str:
    if status is None:
        return head
    # STATUS is a single line: a newline in it would start a new (bogus) assignment.
    line = "STATUS=" + " ".join(status.splitlines())
    return f"{head}\n{line}" if head else line


async def watchdog_loop(notifier: SystemdNotifier) -> None:
    """Send WATCHDOG=1 every `notifier.watchdog_interval()` seconds until cancelled.

    Returns at once when no watchdog is configured. Run it in the server's task group after
    `ready()`: it proves the event loop is alive, so a loop blocked for longer than WatchdogSec
    gets the process killed (SIGABRT) and, with Restart=on-failure, restarted.
    """
    interval = notifier.watchdog_interval()
    if interval is None:
        return
    while True:
        notifier.watchdog()
        await anyio.sleep(interval)
