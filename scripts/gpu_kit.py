#!/usr/bin/env python3
"""The GPU kit's logic, driven by scripts/gpu_check.sh (read that first).

    gpu_kit.py prepare   --check-dir D  [CPU machine] what travels and what the image is assumed to hold,
                                         derived from pyproject.toml and scripts/gpu_image_packages.txt;
                                         downloads D/wheels (carried) and D/machine-wheels (the dry run's image)
    gpu_kit.py size      --check-dir D  [CPU machine] what travels with the tree, against the 64 MiB limit
    gpu_kit.py link-source --dest S     the checkout's folders as pagedserve.<folder> under S (from pyproject)
    gpu_kit.py check-env --site C --out F   [the run's python] every requirement met by what it imports,
                                         carried packages shadowing the image's, every pagedserve module imported
    gpu_kit.py select    --collected F --out-dir D   the collected GPU tests split into the run's test steps
    gpu_kit.py results   --work W --out-dir O   gpu_results.json from the run's pieces; exit code of the run
    gpu_kit.py dry-verify --results F    [dry run] what the real run proved before it stopped at "no GPU"

Standard library only, plus `packaging` (pip's own copy when it is not installed), so that it runs with
the image's python3 before anything is installed, and with any Python >= 3.11 here.
"""

from __future__ import annotations

import argparse
import email.parser
import importlib
import importlib.metadata
import json
import os
import pkgutil
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import defaultdict
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
except ImportError:  # the kit must run before anything is installed: pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parents[1]
IMAGE_FILE = ROOT / "scripts" / "gpu_image_packages.txt"
TRAVEL_LIMIT_BYTES = 64 * 1024 * 1024  # the device tool's limit: working tree + carried paths
MIB = 1024 * 1024
# What the kit itself wants on the machine besides the project's requirements: per-test timeouts
# (the image has pytest-timeout), `packaging` for this module, and nvmath-python, the second cuBLAS route
# scripts/gpu_gemm_probe.py tries (cupy_kernels/cuda/cublas_route.py). Missing ones are warnings, not failures.
# nvmath-python 1.0.1's wheel requires cuda-core >=0.5,<2 and cuda-pathfinder >=1.5.1,<2 (its METADATA): named here
# too, so that the device's check-env reports the image's versions of them against what the wheel needs.
KIT_REQUIREMENTS = ["pytest-timeout>=2.1", "packaging>=21", "nvmath-python>=1.0.1", "cuda-core>=0.5,<2",
                    "cuda-pathfinder>=1.5.1,<2"]
# Test-extra packages that no GPU test imports (the device runs tests/cupy_kernels -m gpu only): ruff is the
# house test's linter, kubernetes-validate the manifest test's schema check. Left out, the kit keeps ~13 MiB
# of its 64 MiB for what the device needs.
NOT_FOR_THE_DEVICE = frozenset({"ruff", "kubernetes-validate"})


def log(msg: str) -> None:
    print(f"gpu_kit: {msg}", file=sys.stderr, flush=True)


def canon(name: str) -> str:
    return canonicalize_name(name)


# -- inputs: the image's package list, pyproject's requirements -------------------------------------------

def load_image(path: Path = IMAGE_FILE) -> dict:
    """{"date", "python", "glibc", "packages": {canonical name: "1.2.3" | "~1.2.3" | "*"}}."""
    info: dict = {"date": None, "python": None, "glibc": None, "packages": {}, "file": str(path)}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"(date|python|glibc):\s*(\S+)", line)
        if m:
            info[m.group(1)] = m.group(2)
            continue
        parts = line.split()
        if len(parts) != 2 or not re.fullmatch(r"\*|~?[0-9][0-9A-Za-z.+!-]*", parts[1]):
            raise SystemExit(f"{path}:{n}: expected 'NAME VERSION' (VERSION: 1.2.3, ~1.2.3 or *), got {raw!r}")
        info["packages"][canon(parts[0])] = parts[1]
    for key in ("date", "python", "glibc"):
        if not info[key]:
            raise SystemExit(f"{path}: the header line '{key}: ...' is missing")
    return info


def image_satisfies(image_version: str | None, req: Requirement) -> bool:
    if image_version is None:
        return False
    if image_version == "*":
        return True
    return req.specifier.contains(image_version.lstrip("~"), prereleases=True)


def _load_pyproject(root: Path) -> dict:
    text = (root / "pyproject.toml").read_text()
    if tomllib is not None:
        return tomllib.loads(text)
    try:
        import tomli  # type: ignore[import-not-found]
    except ImportError:
        raise SystemExit("gpu_kit.py needs Python >= 3.11 (tomllib) or tomli to read pyproject.toml")
    return tomli.loads(text)


def project_requirements(root: Path = ROOT) -> list[tuple[Requirement, str]]:
    """pyproject's runtime dependencies, its test extra, and the kit's own, each with its group."""
    project = _load_pyproject(root)["project"]
    out = [(Requirement(s), "runtime") for s in project.get("dependencies", [])]
    out += [(Requirement(s), "test") for s in project.get("optional-dependencies", {}).get("test", [])
            if Requirement(s).name not in NOT_FOR_THE_DEVICE]
    out += [(Requirement(s), "kit") for s in KIT_REQUIREMENTS]
    return out


def package_dirs(root: Path = ROOT) -> dict[str, str]:
    """{"cupy_kernels": "cupy_kernels", ...}: pagedserve.<key> lives in the checkout's folder <value>."""
    tool = _load_pyproject(root).get("tool", {}).get("setuptools", {})
    dirs = tool.get("package-dir", {})
    out = {}
    for pkg in tool.get("packages", []):
        parts = pkg.split(".")
        if len(parts) == 2 and parts[0] == "pagedserve":
            out[parts[1]] = dirs.get(pkg, parts[1])
    return out


def target_environment(image: dict) -> dict:
    """Marker environment of the machine's python3 (CPython on Linux x86_64)."""
    full = image["python"]
    return {"python_version": ".".join(full.split(".")[:2]), "python_full_version": full,
            "implementation_name": "cpython", "implementation_version": full,
            "platform_python_implementation": "CPython", "platform_system": "Linux", "sys_platform": "linux",
            "platform_machine": "x86_64", "os_name": "posix", "platform_release": "", "platform_version": "",
            "extra": ""}


def marker_ok(req: Requirement, env: dict, extras: set[str] | frozenset = frozenset()) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in (set(extras) or {""}))


def platform_args(image: dict) -> list[str]:
    """pip download's target: CPython <python> manylinux x86_64 up to the image's glibc."""
    major, minor = (int(x) for x in image["glibc"].split(".")[:2])
    assert major == 2
    py = ".".join(image["python"].split(".")[:2])
    args = ["--only-binary=:all:", "--python-version", py, "--implementation", "cp"]
    for m in range(minor, 16, -1):
        args += ["--platform", f"manylinux_2_{m}_x86_64"]
    return args + ["--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64"]


# -- wheels and the closure of what travels -----------------------------------------------------------------

def wheel_info(path: Path) -> dict:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        msg = email.parser.Parser().parsestr(z.read(meta).decode("utf-8", "replace"))
    return {"name": msg["Name"], "version": msg["Version"], "requires": msg.get_all("Requires-Dist") or [],
            "file": path.name, "size": path.stat().st_size}


def wheels_in(folder: Path) -> dict[str, dict]:
    out = {}
    for p in sorted(folder.glob("*.whl")):
        info = wheel_info(p)
        key = canon(info["name"])
        if key in out:
            raise SystemExit(f"{folder}: two wheels of {info['name']} ({out[key]['file']}, {p.name}): keep one")
        out[key] = info
    return out


def resolve(top: list[tuple[Requirement, str]], wheels: dict[str, dict], image: dict, env: dict) -> dict:
    """Decide for every requirement reached from `top` whether the image holds it at a compatible version
    ("image") or a downloaded wheel carries it ("carried"), following the carried wheels' own requirements
    (the image's packages bring their own). Returns {"carried": {name: wheel}, "image": {name: [specs]},
    "missing": [message], "needs": {name: [(spec, needed_by)]}}."""
    pkgs = image["packages"]
    needs: dict[str, list[tuple[Requirement, str]]] = defaultdict(list)
    decided: dict[str, str] = {}
    pending = [(r, by) for r, by in top if marker_ok(r, env)]
    while pending:
        for r, by in pending:
            needs[canon(r.name)].append((r, by))
        pending = []
        for name, rs in needs.items():
            if decided.get(name) == "carried":
                continue
            if all(image_satisfies(pkgs.get(name), r) for r, _ in rs):
                decided[name] = "image"
                continue
            w = wheels.get(name)
            if w is not None and all(r.specifier.contains(w["version"], prereleases=True) for r, _ in rs):
                decided[name] = "carried"
                extras = set().union(*(r.extras for r, _ in rs))
                for s in w["requires"]:
                    dep = Requirement(s)
                    if marker_ok(dep, env, extras):
                        pending.append((dep, f"{w['name']} {w['version']}"))
            else:
                decided[name] = "missing"
    missing = []
    for name, state in sorted(decided.items()):
        if state != "missing":
            continue
        specs = "; ".join(f"{r} (needed by {by})" for r, by in needs[name])
        on_image = pkgs.get(name)
        where = f"the image has {on_image.lstrip('~')}" if on_image else "the image does not have it"
        w = wheels.get(name)
        carried = f"the downloaded wheel is {w['version']}" if w else "no wheel of it was downloaded"
        missing.append(f"{name}: {specs} is neither carried nor on the image ({where}; {carried})")
    return {"carried": {n: wheels[n] for n, s in decided.items() if s == "carried"},
            "image": {n: [str(r.specifier) or "any" for r, _ in needs[n]] for n, s in decided.items() if s == "image"},
            "missing": missing, "needs": {n: [(str(r), by) for r, by in rs] for n, rs in needs.items()}}


def _pip_download(python: str, dest: Path, reqs: list[str], constraints: list[str], image: dict, deps: bool) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(constraints) + "\n")
    cmd = [python, "-m", "pip", "download", "-q", "--dest", str(dest), *platform_args(image), "-c", f.name, *reqs]
    if not deps:
        cmd.insert(4, "--no-deps")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    os.unlink(f.name)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if "is ignored: it is neither" not in ln]
        nomatch = re.findall(r"No matching distribution found for (\S+)", "\n".join(lines))
        if nomatch:
            log(f"no CPython {image['python']} manylinux (glibc <= {image['glibc']}) x86_64 wheel on the index for "
                f"{', '.join(nomatch)}, at a version the image's packages allow: it can neither travel nor be "
                f"assumed present (see scripts/gpu_image_packages.txt)")
        log("pip download failed: " + " ".join(cmd))
        for ln in lines[-12:]:
            print("    " + ln, file=sys.stderr)
        raise SystemExit(5)


def prepare(check_dir: Path, python: str) -> int:
    image = load_image()
    env = target_environment(image)
    pkgs = image["packages"]
    top = [(r, f"pyproject {g}" if g != "kit" else "the GPU kit") for r, g in project_requirements()]
    top = [(r, by) for r, by in top if marker_ok(r, env)]
    to_download = [str(r) for r, _ in top if not image_satisfies(pkgs.get(canon(r.name)), r)]
    downloading = {canon(Requirement(s).name) for s in to_download}
    # Prefer versions that work with what the image holds: cap every read version it has (numpy<=2.5.2, ...).
    caps = [f"{n}<={v}" for n, v in sorted(pkgs.items()) if v[0].isdigit() and n not in downloading]
    work = Path(tempfile.mkdtemp(prefix="gpu_kit_", dir=check_dir.parent if check_dir.parent.exists() else None))
    try:
        travel_dl, machine_dl = work / "travel", work / "machine"
        travel_dl.mkdir()
        machine_dl.mkdir()
        log(f"downloading {', '.join(to_download) or 'nothing'} (+ dependencies) for CPython {image['python']} "
            f"manylinux x86_64, glibc <= {image['glibc']}")
        if to_download:
            _pip_download(python, travel_dl, to_download, caps, image, deps=True)
        res = resolve(top, wheels_in(travel_dl), image, env)
        if res["missing"]:
            for m in res["missing"]:
                log("MISSING: " + m)
            log("a requirement is neither carried nor on the image: fix pyproject.toml or "
                "scripts/gpu_image_packages.txt")
            return 5
        # The dry run's image: every package of the image that the closure touched, at the image's version
        # (read versions capped, stand-ins exact), carried ones included (the image's old copy they must shadow).
        touched = [n for n in res["needs"] if n in pkgs]
        machine_reqs = []
        for n in sorted(touched):
            v = pkgs[n]
            spec = SpecifierSet()
            if n in res["image"]:
                for r, _ in res["needs"][n]:
                    spec &= SpecifierSet(str(Requirement(r).specifier))
            if v.startswith("~"):
                spec = SpecifierSet(f"=={v[1:]}")
            elif v != "*":
                spec &= SpecifierSet(f"<={v}")
            machine_reqs.append(f"{n}{spec}")
        machine_caps = [f"{n}{'==' + v[1:] if v.startswith('~') else '<=' + v}" for n, v in sorted(pkgs.items())
                        if v != "*" and n not in touched]
        log(f"downloading the image's packages for the dry run: {', '.join(machine_reqs)} (+ dependencies)")
        _pip_download(python, machine_dl, machine_reqs, machine_caps, image, deps=True)
        machine = wheels_in(machine_dl)
        dropped = sorted(n for n in machine if n not in pkgs)
        for n in dropped:  # the image lacks it: so must the dry run's image
            (machine_dl / machine[n]["file"]).unlink()
        machine = {n: w for n, w in machine.items() if n in pkgs}
        substituted = {n: {"image": pkgs[n].lstrip("~"), "dry_run": w["version"]} for n, w in sorted(machine.items())
                       if pkgs[n] != "*" and pkgs[n].lstrip("~") != w["version"]}
        for f in travel_dl.glob("*.whl"):
            if canon(wheel_info(f)["name"]) not in res["carried"]:
                f.unlink()  # numpy and the like: the image has them
        for name, src in (("wheels", travel_dl), ("machine-wheels", machine_dl)):
            dest = check_dir / name
            if dest.exists():
                shutil.rmtree(dest)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(src), str(dest))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    travel = [{"name": w["name"], "version": w["version"], "file": w["file"], "size": w["size"],
               "needed_by": sorted({by for _, by in res["needs"][n]})} for n, w in sorted(res["carried"].items())]
    present = [{"name": n, "image": pkgs[n], "required": sorted(set(res["image"][n]))} for n in sorted(res["image"])]
    kit = {"image": {k: image[k] for k in ("date", "python", "glibc", "file")}, "travel": travel, "image_has": present,
           "machine_wheels": sorted(f"{w['name']}=={w['version']}" for w in machine.values()),
           "machine_substituted": substituted, "machine_dropped_not_on_image": dropped,
           "travel_bytes": sum(t["size"] for t in travel)}
    (check_dir / "kit.json").write_text(json.dumps(kit, indent=2) + "\n")
    log(f"travels ({len(travel)} wheels, {kit['travel_bytes'] / MIB:.1f} MiB): "
        + ", ".join(f"{t['name']} {t['version']}" for t in travel))
    log("assumed on the image: " + ", ".join(f"{p['name']} {p['image']}" for p in present))
    for n, s in substituted.items():
        log(f"dry run: the image's {n} {s['image']} is played by {s['dry_run']} (the index here has no {s['image']})")
    if dropped:
        log(f"dry run: left out of the image's venv, not on the image: {', '.join(dropped)}")
    return 0


# -- size -------------------------------------------------------------------------------------------------------

def tree_bytes(root: Path) -> int:
    """What the device tool sends: tracked files and untracked files git does not ignore."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout
    total = 0
    for rel in set(filter(None, out.decode().split("\0"))):
        try:
            total += (root / rel).lstat().st_size
        except FileNotFoundError:
            pass  # deleted in the work tree
    return total


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def size(check_dir: Path, root: Path = ROOT) -> int:
    tree = tree_bytes(root)
    wheels = folder_bytes(check_dir / "wheels")
    ref = folder_bytes(check_dir / "reference")
    total = tree + wheels + ref
    ref_text = f"{ref / MIB:.1f} MiB" if ref else "not computed (about 1.2 MiB)"
    line = (f"travels: .gpu_check/wheels {wheels / MIB:.1f} MiB + .gpu_check/reference {ref_text} "
            f"+ the tree {tree / MIB:.1f} MiB = {total / MIB:.1f} MiB of {TRAVEL_LIMIT_BYTES // MIB} MiB")
    kit_file = check_dir / "kit.json"
    if kit_file.exists():
        kit = json.loads(kit_file.read_text())
        kit["sizes_mib"] = {"wheels": round(wheels / MIB, 2), "reference": round(ref / MIB, 2),
                            "tree": round(tree / MIB, 2), "total": round(total / MIB, 2)}
        kit_file.write_text(json.dumps(kit, indent=2) + "\n")
    if total > TRAVEL_LIMIT_BYTES:
        log(f"TOO BIG: {line}: the device tool refuses more than {TRAVEL_LIMIT_BYTES // MIB} MiB")
        return 5
    log(line)
    return 0


def link_source(dest: Path, root: Path = ROOT) -> int:
    """dest/pagedserve/<pkg> -> the checkout's folder, for every pagedserve.<pkg> pyproject installs."""
    pkg_root = dest / "pagedserve"
    pkg_root.mkdir(parents=True, exist_ok=True)
    for pkg, folder in package_dirs(root).items():
        link = pkg_root / pkg
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(root / folder)
    return 0


# -- check-env: run by the interpreter of the run, PYTHONPATH as the run sets it ---------------------------

def _top_modules(dist: importlib.metadata.Distribution) -> list[str]:
    """Importable top-level names of an installed distribution, from its RECORD (namespace parents
    such as google/ resolved to their first regular package, google.protobuf)."""
    files = [str(f) for f in (dist.files or [])]
    names = set()
    for f in files:
        parts = f.split("/")
        if ".." in parts or parts[0].endswith((".dist-info", ".data")) or "__pycache__" in parts:
            continue
        if len(parts) == 1 and f.endswith(".py"):
            names.add(parts[0][:-3])
        elif len(parts) == 1 and f.endswith(".so"):  # a top-level extension module
            names.add(parts[0].split(".")[0])
        elif len(parts) >= 2 and parts[-1] == "__init__.py":
            names.add(".".join(parts[:-1]))
    # keep the shortest regular packages: google.protobuf, not google.protobuf.internal
    tops = sorted(names, key=lambda n: n.count("."))
    keep: list[str] = []
    for n in tops:
        if not any(n.startswith(k + ".") for k in keep) and not n.startswith("_"):
            keep.append(n)
    return sorted(keep)


def _under(path: str | os.PathLike | None, folder: Path) -> bool:
    """path is folder or lies inside it."""
    if not path:
        return False
    p, f = os.path.realpath(path), os.path.realpath(folder)
    return p == f or p.startswith(f + os.sep)


def check_env(site: Path | None, out: Path, root: Path = ROOT) -> int:
    t0 = time.perf_counter()
    result: dict = {"python": sys.executable, "python_version": platform.python_version(),
                    "python_is_a_venv": sys.prefix != sys.base_prefix, "carried_site": str(site) if site else None}
    problems: list[str] = []
    # 1. every requirement met by what this interpreter imports (PYTHONPATH first)
    reqs = {}
    for r, group in project_requirements(root):
        if not marker_ok(r, {**_default_env()}):
            continue
        entry = {"group": group, "required": str(r.specifier) or "any"}
        try:
            d = importlib.metadata.distribution(r.name)
            entry["found"] = d.version
            entry["from"] = "carried" if site and _under(d.locate_file(""), site) else "image"
            entry["ok"] = r.specifier.contains(d.version, prereleases=True)
        except importlib.metadata.PackageNotFoundError:
            entry["found"], entry["ok"] = None, False
        reqs[r.name] = entry
        if not entry["ok"]:
            what = f"{entry['found']} found" if entry["found"] else "not installed"
            msg = f"{r.name}{r.specifier}: {what} ({group})"
            if group == "kit":
                result.setdefault("warnings", []).append(msg)
            else:
                problems.append(msg)
    result["requirements"] = reqs
    # 2. every carried package is imported from the carried folder, ahead of the image's copy
    carried = {}
    if site and site.exists():
        for d in importlib.metadata.distributions(path=[str(site)]):
            for mod in _top_modules(d):
                try:
                    m = importlib.import_module(mod)
                    where = getattr(m, "__file__", None) or next(iter(getattr(m, "__path__", [])), None)
                    ok = _under(where, site)
                    carried[mod] = {"distribution": f"{d.metadata['Name']}=={d.version}", "from": where, "ok": ok}
                    if not ok:
                        problems.append(f"{mod} is imported from {where}, not from the carried {d.metadata['Name']} "
                                        f"{d.version}: the image's copy shadows it")
                except Exception as e:  # noqa: BLE001 - any import failure is the finding
                    carried[mod] = {"distribution": f"{d.metadata['Name']}=={d.version}", "ok": False,
                                    "error": f"{type(e).__name__}: {e}"}
                    problems.append(f"carried {mod} does not import: {type(e).__name__}: {e}")
    result["carried_modules"] = carried
    # 3. every pagedserve module, in a fixed order; the first missing module named
    modules, failed, first_missing = [], {}, None

    def note(name: str, e: BaseException) -> None:
        nonlocal first_missing
        failed[name] = f"{type(e).__name__}: {e}"
        if first_missing is None and isinstance(e, ModuleNotFoundError):
            first_missing = {"module": e.name, "imported_by": name}

    for pkg in package_dirs(root):
        name = f"pagedserve.{pkg}"
        try:
            p = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            note(name, e)
            continue
        modules.append(name)
        for info in pkgutil.walk_packages(p.__path__, name + ".", onerror=lambda n: None):
            if info.name.rsplit(".", 1)[-1] == "__main__" or info.name in failed:
                continue
            try:
                importlib.import_module(info.name)
                modules.append(info.name)
            except Exception as e:  # noqa: BLE001
                note(info.name, e)
    result["imports"] = {"imported": len(modules), "failed": failed, "first_missing": first_missing}
    if failed:
        first = (f"; first missing module: {first_missing['module']} (imported by {first_missing['imported_by']})"
                 if first_missing else "")
        problems.append(f"{len(failed)} pagedserve module(s) do not import{first}: "
                        + "; ".join(f"{k}: {v}" for k, v in list(failed.items())[:5]))
    # 4. the image's own versions of the listed packages (outside the carried folder), to keep the list true
    try:
        image = load_image()
        search = [p for p in sys.path if not (site and _under(p, site))]
        found = {canon(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=search)
                 if d.metadata["Name"]}
        listed = image["packages"]
        result["image_packages"] = {
            "file_date": image["date"],
            "differences": {n: {"file": v, "found": found[n]} for n, v in sorted(listed.items())
                            if n in found and v != "*" and v.lstrip("~") != found[n]},
            "versions_not_in_file": {n: found[n] for n, v in sorted(listed.items()) if n in found and v == "*"},
            "listed_not_found": sorted(n for n in listed if n not in found),
            "found_not_listed": sorted(n for n in found if n not in listed),
        }
    except Exception as e:  # noqa: BLE001 - informative only
        result["image_packages"] = {"error": f"{type(e).__name__}: {e}"}
    result["problems"] = problems
    result["ok"] = not problems
    result["seconds"] = round(time.perf_counter() - t0, 1)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for w in result.get("warnings", []):
        log(f"warning: {w}")
    for p in problems:
        log(f"PROBLEM: {p}")
    n_carried = sum(1 for v in carried.values() if v["ok"])
    log(f"environment: {sum(1 for v in reqs.values() if v['ok'])}/{len(reqs)} requirements met, "
        f"{n_carried}/{len(carried)} carried modules imported from the carried folder, "
        f"{len(modules)} pagedserve modules imported, {len(failed)} failed ({result['seconds']} s)")
    return 0 if result["ok"] else 3


def _default_env() -> dict:
    try:
        from packaging.markers import default_environment
    except ImportError:
        from pip._vendor.packaging.markers import default_environment  # type: ignore[no-redef]
    return default_environment()


# -- select: the collected GPU tests split into the run's test steps ----------------------------------------------

# What has never run on a device goes first (issue 59), by node id: (step, [(file, name substrings)]); the first
# step a test matches takes it, the rest is the regression suite.
TEST_STEPS = (
    ("tests_runtime", [("test_gpu_runtime.py", ("graph", "capture", "arena", "sampler")),
                       ("test_device_sampler.py", ("",))]),
    ("tests_kernels", [("test_prefill_tc_gpu.py", ("",)),
                       ("", ("bf16", "bfloat16", "head_dim_256", "sliding_window", "window"))]),
)
REGRESSION_STEP = "tests_regression"


def split_tests(nodeids: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {name: [] for name, _ in TEST_STEPS}
    out[REGRESSION_STEP] = []
    for nodeid in nodeids:
        path, _, test = nodeid.partition("::")
        for name, rules in TEST_STEPS:
            if any(path.endswith(f) and any(k in test for k in keys) for f, keys in rules):
                out[name].append(nodeid)
                break
        else:
            out[REGRESSION_STEP].append(nodeid)
    return out


def select(collected: Path, out_dir: Path) -> int:
    rec = read_test_records(collected)
    if not rec["collected"]:
        log(f"select: no collected tests in {collected}")
        return 3
    parts = split_tests(rec["collected"])
    for name, ids in parts.items():
        (out_dir / f"{name}.txt").write_text("".join(i + "\n" for i in ids))
    log("split " + ", ".join(f"{name} {len(ids)}" for name, ids in parts.items()))
    return 0


# -- results ---------------------------------------------------------------------------------------------------

def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tail(path: Path, n: int = 20, width: int = 400) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []
    return [ln if len(ln) <= width else ln[:width] + " [...]" for ln in lines]


def read_test_records(path: Path) -> dict:
    """What scripts/gpu_pytest_record.py wrote, line by line: survives a kill at any point."""
    collected: list[str] = []
    started: list[str] = []
    reports: dict[str, list[dict]] = defaultdict(list)
    interrupted = None
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        kind = rec.get("event")
        if kind == "collected":
            collected = rec["nodeids"]
        elif kind == "start":
            started.append(rec["nodeid"])
        elif kind == "report":
            reports[rec["nodeid"]].append(rec)
        elif kind == "interrupted":
            interrupted = rec.get("why")
    outcome: dict[str, dict] = {}
    for nodeid, reps in reports.items():
        bad = [r for r in reps if r["outcome"] == "failed"]
        if any(r["when"] == "call" and r["outcome"] == "failed" for r in bad):
            outcome[nodeid] = {"state": "failed", **_msg(next(r for r in bad if r["when"] == "call"))}
        elif bad:
            outcome[nodeid] = {"state": "error", **_msg(bad[0])}
        elif any(r["outcome"] == "skipped" for r in reps):
            outcome[nodeid] = {"state": "skipped", **_msg(next(r for r in reps if r["outcome"] == "skipped"))}
        elif any(r["when"] == "call" and r["outcome"] == "passed" for r in reps):
            outcome[nodeid] = {"state": "passed"}
        if nodeid in outcome:
            outcome[nodeid]["seconds"] = round(sum(r.get("duration", 0) for r in reps), 2)
    finished_teardown = {n for n, reps in reports.items() if any(r["when"] == "teardown" for r in reps)}
    unfinished = []
    for nodeid in collected or started:
        if nodeid in finished_teardown:
            continue
        if nodeid in started:
            unfinished.append({"test": nodeid, "state": "running when the run stopped",
                               "message": interrupted or "no report: killed by the budget's timeout"})
        elif nodeid not in outcome:
            unfinished.append({"test": nodeid, "state": "not started", "message": interrupted or "the budget ran out"})
    return {"collected": collected, "outcome": outcome, "unfinished": unfinished, "interrupted": interrupted}


def _msg(rec: dict) -> dict:
    return {"message": rec.get("message", ""), "detail": rec.get("detail", "")}


def test_summary(records: dict, rc: int | None) -> dict:
    oc = records["outcome"]

    def named(state: str) -> list[dict]:
        return [{"test": n, "message": o["message"], **({"detail": o["detail"]} if o.get("detail") else {})}
                for n, o in oc.items() if o["state"] == state]

    slowest = sorted(((o.get("seconds", 0), n) for n, o in oc.items()), reverse=True)[:8]
    return {"exit_code": rc, "collected": len(records["collected"]),
            "passed": sum(1 for o in oc.values() if o["state"] == "passed"),
            "failed": len(named("failed")), "errors": len(named("error")), "skipped": len(named("skipped")),
            "unfinished": len(records["unfinished"]),
            "failed_tests": named("failed"), "error_tests": named("error"), "skipped_tests": named("skipped"),
            "unfinished_tests": records["unfinished"], "interrupted": records["interrupted"],
            "slowest": [{"test": n, "seconds": s} for s, n in slowest]}


def bench_result(work: Path, name: str, final: bool = True) -> dict:
    """A benchmark's stdout must be exactly one JSON object; anything else fails the run, loudly. A step that
    wrote $GPU_STEP_PARTIAL as it went (the GEMM probe, route by route) keeps that part when it is killed."""
    rc_text = (work / f"{name}.rc").read_text().strip() if (work / f"{name}.rc").exists() else None
    if rc_text is None:
        return {"ok": False, "error": "not run: the time budget ran out" if final else "not run yet"}
    rc = int(rc_text)
    raw = (work / f"{name}.out").read_text(errors="replace") if (work / f"{name}.out").exists() else ""
    stderr_tail = _tail(work / f"{name}.err", 15)
    try:
        value = json.loads(raw)
        if not isinstance(value, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        out = {"ok": False, "exit_code": rc,
               "error": f"stdout did not parse as JSON ({e})" + (" - timed out" if rc in (124, 137) else ""),
               "stdout_head": raw.splitlines()[:5], "stderr_tail": stderr_tail}
        partial = _read_json(work / f"{name}.partial.json")
        if isinstance(partial, dict):
            out["partial"] = partial
        return out
    if rc != 0:
        return {"ok": False, "exit_code": rc, "error": "non-zero exit", "output": value, "stderr_tail": stderr_tail}
    return value


def kernel_errors(path: Path) -> dict:
    errors: dict = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return errors
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        name = rec.pop("name", "?")
        agg = errors.setdefault(name.split("/")[0], {})
        for key, value in rec.items():
            if not isinstance(value, (int, float)):
                continue
            better_low = key not in ("top1_agreement", "decided_rows", "max_abs_logit")
            old = agg.get(key)
            agg[key] = value if old is None else (max(old, value) if better_low else min(old, value))
        errors.setdefault("_all", []).append({"name": name, **rec})
    return errors


def steps(work: Path) -> dict:
    out = {}
    for line in _tail(work / "steps.txt", 1000):
        parts = line.split(maxsplit=3)
        if len(parts) >= 3:
            out[parts[0]] = {"exit_code": int(parts[1]), "seconds": int(parts[2]),
                             **({"note": parts[3]} if len(parts) > 3 else {})}
    return out


GRAVITY = {0: 0, 1: 1, 3: 2, 4: 3, 2: 4}
# The run's JSON-printing steps (scripts/gpu_check.sh's run_bench), in the order they run.
BENCH_STEPS = ("gemm_probe", "bench_decode", "bench_prefill", "bench_sampler", "bench_attention", "sanitizer",
               "bench_throughput")


def results(work: Path, out_dir: Path, meta: dict) -> int:
    """gpu_results.json from the run's pieces; returns the run's exit status (see gpu_check.sh)."""
    st = steps(work)
    result: dict = {"kit": meta, "steps": st}
    failures: list[str] = []
    exit_code = 0

    def fail(code: int, why: str) -> None:  # the run's status is its gravest failure's: 2 > 4 > 3 > 1
        nonlocal exit_code
        failures.append(why)
        if GRAVITY[code] > GRAVITY[exit_code]:
            exit_code = code

    install = st.get("install", {})
    result["install"] = {**install, "carried": _tail(work / "carried.txt", 1000),
                         "log_tail": _tail(work / "install.log", 12)}
    if install.get("exit_code", 0) != 0:
        fail(3, "the carried wheels did not install: " + " / ".join(_tail(work / "install.log", 3)))
    env = _read_json(work / "environment.json")
    if env is None:
        fail(3, "the environment check wrote nothing: " + " / ".join(_tail(work / "environment.log", 5)))
        result["environment"] = {"log_tail": _tail(work / "environment.log", 30)}
    else:
        result["imports"] = env.pop("imports", None)
        result["image_packages"] = env.pop("image_packages", None)
        result["environment"] = env
        for p in env.get("problems", []):
            fail(3, p)
    collect = st.get("collect")
    if collect is not None:
        m = re.search(r"(\d+)(?:/(\d+))? tests? (?:collected|selected)", "\n".join(_tail(work / "collect.log", 5)))
        result["collected"] = {"gpu_tests": int(m.group(1)) if m else 0, "exit_code": collect["exit_code"],
                               "log_tail": [] if collect["exit_code"] == 0 else _tail(work / "collect.log", 20)}
        if collect["exit_code"] != 0 or not m:
            fail(3, "the GPU tests do not collect: " + " / ".join(_tail(work / "collect.log", 3)))
    pre = _read_json(work / "preflight.json") or {}
    result["device"] = pre.get("device")
    result["preflight"] = pre
    if "no_gpu" in pre:
        fail(2, f"no usable GPU: {pre['no_gpu']}")
    elif not pre:
        fail(2, "the GPU preflight wrote nothing: " + " / ".join(_tail(work / "preflight.log", 5)))
    elif any(str(v).startswith("FAILED") for v in pre.values()):
        fail(4, "CUDA libraries did not all load: "
             + "; ".join(f"{k}: {v}" for k, v in pre.items() if str(v).startswith("FAILED")))
    final = meta.get("final", True)
    past_preflight = bool(pre) and "no_gpu" not in pre and not any(str(v).startswith("FAILED") for v in pre.values())
    per_test = meta.get("per_test_timeout_s")
    for name in [n for n, _ in TEST_STEPS] + [REGRESSION_STEP]:
        if name not in st:
            if past_preflight and final:
                fail(1, f"{name}: not run, the time budget ran out")
                result[name] = {"error": "not run: the time budget ran out"}
            continue
        rec = read_test_records(work / f"{name}.jsonl")
        tests = test_summary(rec, st[name]["exit_code"])
        tests.update({"per_test_timeout_s": per_test, "seconds": st[name]["seconds"], "log": f"gpu_{name}.log",
                      "junit": f"gpu_{name}.xml"})
        result[name] = tests
        if st[name]["exit_code"] in (124, 137):
            fail(1, f"{name} ran out of its time: {tests['unfinished']} unfinished")
        if tests["failed"] or tests["errors"]:
            fail(1, f"{name}: {tests['failed']} GPU test(s) failed, {tests['errors']} errored: "
                 + ", ".join(t["test"] for t in tests["failed_tests"] + tests["error_tests"]))
        if tests["skipped"]:
            fail(1, f"{name}: GPU tests SKIPPED on the GPU machine ({tests['skipped']}): a skipped GPU test checked "
                 "nothing")
        if not tests["collected"] and st[name].get("note") != "no tests":
            fail(1, f"{name}: no GPU test ran: " + " / ".join(_tail(out_dir / f"gpu_{name}.log", 5)))
        elif st[name]["exit_code"] not in (0, 124, 137) and not (tests["failed"] or tests["errors"]):
            fail(1, f"{name}: pytest exited {st[name]['exit_code']}: "
                 + " / ".join(_tail(out_dir / f"gpu_{name}.log", 3)))
    if past_preflight:
        result["kernel_errors"] = kernel_errors(work / "errors.jsonl")
        for name in BENCH_STEPS:
            value = bench_result(work, name, final)
            result[name] = value
            if value.get("ok") is False and (final or (work / f"{name}.rc").exists()):
                fail(1, f"{name}: {value['error']}")
                log(f"{name.upper()} FAILED: {value['error']}"
                    + (f"; stdout began {value['stdout_head'][:2]}" if value.get("stdout_head") else ""))
        for name in ("precompile", "precompile_rest"):  # NVRTC per module, into the kernel cache (not a failure)
            pre_out = _read_json(work / f"{name}.out")
            result[name] = pre_out if pre_out is not None else {
                "exit_code": _tail(work / f"{name}.rc", 1), "stderr_tail": _tail(work / f"{name}.err", 12)}
    result["failures"] = failures
    result["exit_code"] = exit_code
    result["seconds"] = meta.get("seconds")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_results.json").write_text(json.dumps(result, indent=2) + "\n")
    for f in failures:
        log(f"FAILED: {f}")
    att = (result.get("attention") or {}).get("headline_pct_of_peak_bandwidth")
    log(f"wrote {out_dir / 'gpu_results.json'} (exit {exit_code}"
        + (f"; attention headline {att}% of peak bandwidth" if att is not None else "") + ")")
    return exit_code


def dry_verify(path: Path, expect_carried: int) -> int:
    """The real run, stopped at "no GPU" in the dry run, must have proved everything before the GPU."""
    r = _read_json(path)
    if r is None:
        log(f"the real run wrote no {path}")
        return 1
    bad = []
    env = r.get("environment", {})
    if r.get("exit_code") != 2 or "no_gpu" not in r.get("preflight", {}):
        bad.append(f"expected the real run to stop at the GPU preflight (exit 2), got exit {r.get('exit_code')}: "
                   f"{r.get('failures')}")
    if not env.get("python_is_a_venv"):
        bad.append("the run's python was not a venv: the dry run must play the image's venv python3")
    if r.get("install", {}).get("exit_code") != 0 or len(r.get("install", {}).get("carried", [])) != expect_carried:
        bad.append(f"install step: {r.get('install')}")
    if not env.get("ok"):
        bad.append(f"environment: {env.get('problems')}")
    imports = r.get("imports") or {}
    if imports.get("failed") or not imports.get("imported"):
        bad.append(f"imports: {imports}")
    if not (r.get("collected") or {}).get("gpu_tests"):
        bad.append(f"collection: {r.get('collected')}")
    if not r.get("kit", {}).get("per_test_timeout_s"):
        bad.append("the GPU tests were collected without a per-test timeout: pytest-timeout is missing from the "
                   "image's packages (.gpu_check/machine-wheels)")
    for b in bad:
        log("DRY RUN: " + b)
    if not bad:
        carried_mods = [m for m, v in env.get("carried_modules", {}).items() if v.get("ok")]
        log(f"the real run's own steps, with a venv python3 over the image's packages: {expect_carried} carried wheels "
            f"installed --no-deps --target and first on PYTHONPATH ({len(carried_mods)} carried modules imported from "
            f"there, the image's copies shadowed), {len(env.get('requirements', {}))} requirements met, "
            f"{imports['imported']} pagedserve modules imported, {r['collected']['gpu_tests']} GPU tests collected "
            f"with the run's pytest options ({r['kit']['per_test_timeout_s']} s per test), "
            f"then exit 2 at the GPU preflight ({r['preflight']['no_gpu'][:60]})")
    return 1 if bad else 0


# -- command line ------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--check-dir", type=Path, required=True)
    p.add_argument("--pip-python", default=sys.executable, help="the python whose pip downloads")
    p = sub.add_parser("size")
    p.add_argument("--check-dir", type=Path, required=True)
    p = sub.add_parser("link-source")
    p.add_argument("--dest", type=Path, required=True)
    p = sub.add_parser("check-env")
    p.add_argument("--site", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose pyproject.toml is read")
    p = sub.add_parser("results")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--meta", default="{}", help="JSON: the run's settings and figures from the shell")
    p = sub.add_parser("select")
    p.add_argument("--collected", type=Path, required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p = sub.add_parser("dry-verify")
    p.add_argument("--results", type=Path, required=True)
    p.add_argument("--expect-carried", type=int, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        return prepare(a.check_dir.resolve(), a.pip_python)
    if a.cmd == "size":
        return size(a.check_dir.resolve())
    if a.cmd == "link-source":
        return link_source(a.dest)
    if a.cmd == "check-env":
        return check_env(a.site, a.out, a.root)
    if a.cmd == "results":
        return results(a.work, a.out_dir, json.loads(a.meta))
    if a.cmd == "select":
        return select(a.collected, a.out_dir)
    if a.cmd == "dry-verify":
        return dry_verify(a.results, a.expect_carried)
    return 2


if __name__ == "__main__":
    sys.exit(main())
