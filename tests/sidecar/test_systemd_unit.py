"""systemd/pagedserve.service: systemd itself accepts it, and it says what the docs promise.

`systemd-analyze verify` is systemd's own parser, run offline (no running systemd needed). It
reports problems as lines naming the unit file and keeps exit status 0 for many of them (an unknown
key, an unparsable value), so the test fails on any output line that names our unit, not only on
the exit status.

verify also insists that ExecStart= names an existing executable, and /opt/pagedserve/.venv/bin/
pagedserve exists only on an installed host. So the test verifies a temporary copy whose ExecStart=
points at this interpreter (sys.executable) instead; every other line is checked as written.

systemd-analyze ships in Debian's `systemd` package. Without it these tests fail (not skip) and say
how to install it, so that a CI machine without it is noticed rather than silently passing.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.sidecar.settings import ENV_PREFIX, Settings, load_settings

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "pagedserve.service"
ENV_EXAMPLE = REPO / "systemd" / "pagedserve.env.example"

# Every setting `pagedserve serve` reads from the environment: one per Settings field, plus the
# weight cache's directory (read by pagedserve.models.loading.weight_cache).
SETTINGS = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(Settings)} | {"PAGEDSERVE_CACHE_DIR"}

INSTALL_HINT = ("systemd-analyze was not found on PATH. It ships in the `systemd` package; on Debian/Ubuntu "
                "install it with: apt-get update && apt-get install -y systemd  (no running systemd is needed)")


def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    return path


def parse_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """Sections -> (key, value) pairs in order; keys may repeat (DeviceAllow=, Environment=, ...)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for raw in text.replace("\\\n", " ").splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"assignment outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not a KEY=VALUE line: {line!r}"
        current.append((key.strip(), value.strip()))
    return sections


def values(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def single(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> str:
    found = values(unit, section, key)
    assert len(found) == 1, f"[{section}] {key}= should be set exactly once, found {found}"
    return found[0]


def seconds(value: str) -> float:
    """A systemd time span as used in this unit: "30", "30s", "5min", "2min 30s"."""
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        assert unit in units, f"unexpected time unit in {value!r}"
        total += float(number) * units[unit]
    return total


@pytest.fixture(scope="module")
def unit() -> dict[str, list[tuple[str, str]]]:
    return parse_unit(UNIT.read_text())


def env_example_defaults() -> dict[str, str]:
    """`#NAME=default` lines of the example file -> {NAME: default}."""
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if m := re.fullmatch(r"#(PAGEDSERVE_[A-Z_]+)=(.*)", line):
            out[m.group(1)] = m.group(2)
    return out


def verify_problems(unit_text: str, tmp_path: Path) -> tuple[int, list[str]]:
    """Run `systemd-analyze verify` on `unit_text` saved as pagedserve.service; (exit status, lines
    of output that name the unit)."""
    exe = systemd_analyze()
    # See the module docstring: the installed ExecStart binary does not exist here.
    text, n = re.subn(r"(?m)^ExecStart=\S+", f"ExecStart={sys.executable}", unit_text)
    assert n == 1, "expected exactly one ExecStart= line to substitute"
    path = tmp_path / "pagedserve.service"  # verify takes the unit name from the file name
    path.write_text(text)
    proc = subprocess.run([exe, "verify", "--man=no", "--recursive-errors=no", str(path)],
                          capture_output=True, text=True, timeout=60)
    output = (proc.stdout + proc.stderr).splitlines()
    return proc.returncode, [line for line in output if "pagedserve.service" in line]


def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    rc, problems = verify_problems(UNIT.read_text(), tmp_path)
    assert problems == []
    assert rc == 0


@pytest.mark.parametrize("breakage", [
    ("Type=notify", "Type=notfy"),  # an unparsable value: systemd warns, exit status stays 0
    ("WatchdogSec=30", "WatchdogSec=30\nWachdogSec=30"),  # an unknown key: the same
])
def test_verify_check_catches_mistakes(tmp_path, breakage):
    """The check above can fail: a broken copy of the unit yields problem lines."""
    old, new = breakage
    text = UNIT.read_text()
    assert old in text
    _, problems = verify_problems(text.replace(old, new, 1), tmp_path)
    assert problems, "systemd-analyze verify reported nothing for a broken unit"


def test_security_exposure_stays_low(tmp_path):
    """`systemd-analyze security` scores the sandboxing 0 (tight) .. 10 (none); the unit scores about
    1.7 today. Fail if a change loosens it past 2.5 (threshold is in tenths)."""
    exe = systemd_analyze()
    text = re.sub(r"(?m)^ExecStart=\S+", f"ExecStart={sys.executable}", UNIT.read_text())
    path = tmp_path / "pagedserve.service"
    path.write_text(text)
    proc = subprocess.run([exe, "security", "--offline=yes", "--threshold=25", "--no-pager", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Overall exposure level for pagedserve.service" in proc.stdout


def test_readiness_and_watchdog(unit):
    assert single(unit, "Service", "Type") == "notify"
    assert single(unit, "Service", "NotifyAccess") == "main"
    watchdog = seconds(single(unit, "Service", "WatchdogSec"))
    # Pings come every WatchdogSec/2 from the event loop; too short a limit kills a busy server.
    assert 10 <= watchdog <= 120
    # The watchdog starts only after READY=1: loading is bounded by TimeoutStartSec instead, which
    # must cover a first start that dequantizes a GGUF (~15 s for the embedded model).
    assert seconds(single(unit, "Service", "TimeoutStartSec")) >= 120


def test_exec_start_and_environment(unit):
    exec_start = single(unit, "Service", "ExecStart").split()
    assert exec_start == ["/opt/pagedserve/.venv/bin/pagedserve", "serve"]
    assert single(unit, "Service", "EnvironmentFile") == "-/etc/pagedserve/pagedserve.env"
    env = dict(v.split("=", 1) for v in values(unit, "Service", "Environment"))
    assert env["PAGEDSERVE_CACHE_DIR"] in ("%C/pagedserve", "${CACHE_DIRECTORY}", "$CACHE_DIRECTORY")
    assert single(unit, "Service", "CacheDirectory") == "pagedserve"
    # The unit's socket path is the client's default (%t is /run for system services).
    from pagedserve.sidecar.client import DEFAULT_SOCKET
    assert env["PAGEDSERVE_SOCKET"].replace("%t", "/run") == DEFAULT_SOCKET
    assert single(unit, "Service", "RuntimeDirectory") == Path(DEFAULT_SOCKET).parent.name


def test_stop_and_restart(unit):
    assert single(unit, "Service", "KillSignal") == "SIGTERM"
    assert single(unit, "Service", "Restart") == "on-failure"
    assert seconds(single(unit, "Service", "RestartSec")) > 0
    drain = float(env_example_defaults()["PAGEDSERVE_DRAIN_TIMEOUT"])
    # systemd SIGKILLs after TimeoutStopSec: it must outlast the drain plus shutdown.
    assert seconds(single(unit, "Service", "TimeoutStopSec")) >= drain + 10


def test_user_and_directories(unit):
    assert single(unit, "Service", "User") == "pagedserve"
    assert single(unit, "Service", "Group") == "pagedserve"
    assert values(unit, "Service", "DynamicUser") in ([], ["no"])
    assert single(unit, "Service", "RuntimeDirectoryMode") == "0750"
    assert single(unit, "Service", "RuntimeDirectoryPreserve") == "yes"


def test_hardening(unit):
    expected = {
        "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
        "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes", "ProtectControlGroups": "yes",
        "RestrictNamespaces": "yes", "LockPersonality": "yes", "RestrictRealtime": "yes",
        "SystemCallArchitectures": "native", "CapabilityBoundingSet": "",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
    }
    for key, value in expected.items():
        assert single(unit, "Service", key) == value, key
    # Left off on purpose (see the unit): CuPy/NVRTC and the CUDA driver may need W+X memory.
    assert values(unit, "Service", "MemoryDenyWriteExecute") in ([], ["no"])


def test_gpu_devices_are_allowed(unit):
    assert single(unit, "Service", "PrivateDevices") == "no"
    assert single(unit, "Service", "DevicePolicy") == "closed"
    allowed = {v.split()[0]: v.split()[1] for v in values(unit, "Service", "DeviceAllow")}
    # nvidia-frontend (major 195) covers /dev/nvidiactl and every /dev/nvidiaN; nvidia-uvm covers
    # /dev/nvidia-uvm and /dev/nvidia-uvm-tools.
    assert allowed.get("char-nvidia-frontend") == "rw"
    assert allowed.get("char-nvidia-uvm") == "rw"


def test_env_example_documents_every_setting():
    text = ENV_EXAMPLE.read_text()
    for number, line in enumerate(text.splitlines(), 1):
        # Everything is commented out: an unedited copy changes no default.
        assert not line.strip() or line.startswith("#"), f"line {number} is not a comment: {line!r}"
    assert set(env_example_defaults()) == SETTINGS
    mentioned = set(re.findall(r"PAGEDSERVE_[A-Z_]+", text))
    assert mentioned == SETTINGS, f"unknown names: {mentioned - SETTINGS}"


def test_env_example_shows_the_real_defaults():
    """Each `#PAGEDSERVE_X=value` line, read the way the server reads it, equals Settings' default
    (fields whose default is None, "unset", show an example value instead and are skipped)."""
    shown = env_example_defaults()
    checked = 0
    for f in dataclasses.fields(Settings):
        if f.default is None:
            continue
        name = ENV_PREFIX + f.name.upper()
        assert getattr(load_settings(None, {name: shown[name]}), f.name) == f.default, name
        checked += 1
    assert checked >= 10
    assert shown["PAGEDSERVE_SOCKET"] == "/run/pagedserve/pagedserve.sock"


def test_memory_limits_are_set_and_ordered(unit):
    def gib(value: str) -> float:
        number, suffix = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)", value).groups()
        return float(number) * {"": 2**-30, "K": 2**-20, "M": 2**-10, "G": 1, "T": 1024}[suffix]

    high, hard = gib(single(unit, "Service", "MemoryHigh")), gib(single(unit, "Service", "MemoryMax"))
    # MemoryHigh throttles before MemoryMax kills; both above the ~5 GiB the default CPU settings budget.
    assert 5 <= high < hard
    assert single(unit, "Service", "MemorySwapMax") == "0"
