"""deploy/kubernetes: every overlay renders (tests/kustomize_lite.py, kustomize's
semantics for the subset used) and validates against the Kubernetes OpenAPI schemas
(kubernetes-validate, schemas inside the package, strict: unknown fields fail); the
manifests' ports, probes, flags and paths agree with the CLI parsers and config
classes, with the Dockerfiles and with docker/compose.yaml, so they cannot drift apart."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import subprocess
import sys
import typing

import pytest
import yaml

from calibrl.config import apply_overrides, from_dict
from tests.kustomize_lite import build

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="the dev extra: pip install 'calibrl[dev]'")

ROOT = pathlib.Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
TLS = K8S / "components" / "tls"
# Oldest version whose schemas know every field used (gRPC probes are GA from 1.27), and the newest.
K8S_VERSIONS = ("1.27.0", "1.37.0")
# The drain delay another change adds before NOT_SERVING pods stop (serving.drain_seconds-style,
# default a few seconds): 5 s assumed until it lands; the test reads the real default when it exists.
ASSUMED_DRAIN_S = 5.0
TRAINER_NAMESPACE = "calibrl-training"

SERVICE_OVERLAYS = {
    "cpu": (K8S / "overlays" / "cpu", ()),
    "gpu": (K8S / "overlays" / "gpu", ()),
    "cpu+tls": (K8S / "overlays" / "cpu", (TLS,)),
    "gpu+tls": (K8S / "overlays" / "gpu", (TLS,)),
}


def _render(name: str) -> list[dict]:
    folder, components = SERVICE_OVERLAYS[name]
    return build(folder, components)


def _one(objects: list[dict], kind: str, name: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def _pytorchjob() -> dict:
    return yaml.safe_load((K8S / "trainer" / "pytorchjob.yaml").read_text())


def _validate(obj: dict) -> None:
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} is not valid for Kubernetes {version}: "
                        f"{exc.message} at {'/'.join(map(str, exc.path))}")


# --------------------------------------------------------------------------- rendering and schemas


@pytest.mark.parametrize("overlay", sorted(SERVICE_OVERLAYS))
def test_service_overlay_renders_and_validates(overlay):
    objects = _render(overlay)
    for obj in objects:
        _validate(obj)
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objects) == sorted([
        ("Namespace", "calibrl"), ("NetworkPolicy", "calibrl-services"),
        *[(kind, name) for name in ("retrieval", "judge")
          for kind in ("Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler")],
    ])
    for obj in objects:
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "calibrl"
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "calibrl"


def test_trainer_job_renders_and_validates():
    objects = build(K8S / "trainer")
    for obj in objects:
        _validate(obj)
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objects) == [
        ("Job", "calibrl-train"), ("Namespace", TRAINER_NAMESPACE)]
    job = _one(objects, "Job", "calibrl-train")
    assert job["metadata"]["namespace"] == TRAINER_NAMESPACE
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == "calibrl-trainer:latest"


def test_pytorchjob_runs_torchrun_in_pods_that_validate():
    job = _pytorchjob()
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert job["metadata"]["namespace"] == TRAINER_NAMESPACE
    assert isinstance(job["spec"]["nprocPerNode"], str)  # the operator's field is a string ("8", "auto")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    for role, spec in replicas.items():
        assert spec["restartPolicy"] in ("Never", "OnFailure", "ExitCode", "Always")
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "pytorch", "the training operator finds the container by this name"
        assert container["command"] == ["torchrun", "-m", "calibrl.cli", "train"]
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert gpus == int(job["spec"]["nprocPerNode"]), "one process per GPU"
        # The pod template itself, checked against the core schema as a PodTemplate.
        _validate({"apiVersion": "v1", "kind": "PodTemplate",
                   "metadata": {"name": f"pytorchjob-{role.lower()}", "namespace": TRAINER_NAMESPACE},
                   "template": spec["template"]})


def test_the_renderer_refuses_what_it_does_not_implement(tmp_path):
    from tests.kustomize_lite import KustomizeError

    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {a: b}\n")
    with pytest.raises(KustomizeError, match=r"unsupported keys \['commonLabels'\]"):
        build(tmp_path)


def test_gpu_overlay_gives_the_judge_a_gpu_and_the_cpu_overlay_does_not():
    for overlay, gpu in (("cpu", False), ("gpu", True)):
        objects = _render(overlay)
        judge = _one(objects, "Deployment", "judge")["spec"]["template"]["spec"]
        retrieval = _one(objects, "Deployment", "retrieval")["spec"]["template"]["spec"]
        limits = judge["containers"][0]["resources"].get("limits", {})
        assert ("nvidia.com/gpu" in limits) == gpu
        assert "nvidia.com/gpu" not in retrieval["containers"][0]["resources"].get("limits", {})
        if gpu:
            assert limits["nvidia.com/gpu"] == 1
            assert any(t["key"] == "nvidia.com/gpu" for t in judge["tolerations"])
            assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in judge["volumes"]
            hpa = _one(objects, "HorizontalPodAutoscaler", "judge")["spec"]
            assert (hpa["minReplicas"], hpa["maxReplicas"]) == (1, 4)


# --------------------------------------------------------------------------- manifests vs CLI, Dockerfiles, compose


class _Stop(Exception):
    """Raised by the patched config loader: the CLI parsed its flags, serving is not wanted."""


def _cli_config(monkeypatch, module: typing.Any, attribute: str, run: typing.Callable[[], object]):
    """Run a CLI entry point up to its config loading; returns (config class or None, file, overrides)."""
    captured: dict = {}

    def capture(*args):
        captured["args"] = args
        raise _Stop

    monkeypatch.setattr(module, attribute, capture)
    with pytest.raises(_Stop):
        run()
    return captured["args"]


def _config_from_overrides(cls: type, overrides: list[str]):
    """Build ``cls`` from the overrides alone: unknown keys and bad types fail as at load."""
    return from_dict(cls, apply_overrides({}, overrides, cls))


def _dockerfile(name: str) -> dict:
    text = (ROOT / "docker" / f"{name}.Dockerfile").read_text()
    return {
        "entrypoint": json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1)),
        "expose": [int(p) for p in re.findall(r"^EXPOSE (\d+)$", text, re.M)],
        "user": int(re.search(r"^USER (\d+)$", text, re.M).group(1)),
        "healthcheck_service": (re.search(r"--service\", \"([\w.]+)\"", text) or [None, None])[1],
    }


def _compose_images() -> dict[str, dict]:
    """image -> {dockerfile, command, build args} of docker/compose.yaml's services."""
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    return {
        service["image"]: {"dockerfile": pathlib.Path(service["build"]["dockerfile"]).stem,  # docker/NAME.Dockerfile
                           "command": service.get("command", []), "args": service["build"].get("args", {})}
        for service in compose["services"].values()
    }


def _drain_delay_s(serving: typing.Any) -> float:
    names = [f.name for f in dataclasses.fields(serving) if "drain" in f.name]
    return max([float(getattr(serving, n)) for n in names] + [ASSUMED_DRAIN_S])


def _mounts(container: dict, pod: dict) -> dict[str, tuple[dict, dict]]:
    volumes = {v["name"]: v for v in pod["volumes"]}
    return {m["mountPath"]: (m, volumes[m["name"]]) for m in container.get("volumeMounts", [])}


def _under(path: str, mounts: dict, read_only: bool | None = None) -> tuple[dict, dict]:
    hits = [(m, v) for mount_path, (m, v) in mounts.items() if path == mount_path or path.startswith(mount_path + "/")]
    assert hits, f"{path} is not on any mounted volume"
    mount, volume = max(hits, key=lambda mv: len(mv[0]["mountPath"]))
    if read_only is not None:
        assert bool(mount.get("readOnly")) == read_only, f"{path}: mounted readOnly={mount.get('readOnly')}"
    return mount, volume


SERVERS = {
    # deployment name -> (Dockerfile, CLI module, config class path, gRPC service constant)
    "retrieval": ("retrieval", "calibrl.retrieval_server.cli", "calibrl.retrieval_server.servicer:SERVICE_NAME"),
    "judge": ("judge", "calibrl.judge_server.cli", "calibrl.judge_server.server:SERVICE_NAME"),
}


@pytest.mark.parametrize("overlay", sorted(SERVICE_OVERLAYS))
def test_service_manifests_match_the_cli_dockerfiles_and_compose(overlay, monkeypatch):
    import importlib

    import calibrl.config

    objects = _render(overlay)
    compose = _compose_images()
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    for name, (dockerfile_name, cli_module, service_constant) in SERVERS.items():
        deployment = _one(objects, "Deployment", name)
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        docker = _dockerfile(dockerfile_name)

        # The image is one compose builds, from this service's Dockerfile, with the same judge backend kind.
        built = compose[container["image"]]
        assert built["dockerfile"] == dockerfile_name, (container["image"], built)
        # No command: the Dockerfile's ENTRYPOINT runs, and the args go to its CLI.
        assert "command" not in container
        assert docker["entrypoint"] == ["calibrl", "serve", name]
        module = importlib.import_module(cli_module)
        cls, config_file, overrides = _cli_config(monkeypatch, calibrl.config, "load_config",
                                                  lambda: module.serve(list(container["args"])))
        assert config_file is None
        config = _config_from_overrides(cls, overrides)
        if name == "judge":
            compose_backend = built["command"][built["command"].index("--backend") + 1]
            assert config.judge.backend.split(":")[0] == compose_backend.split(":")[0]
            assert overlay.startswith("gpu") == config.judge.backend.startswith("vllm:")

        # Ports: config == containerPort == Dockerfile EXPOSE == Service targetPort == probes.
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        serving = config.serving
        assert serving.host == "0.0.0.0"
        assert ports["grpc"] == serving.port and docker["expose"] == [serving.port]
        telemetry = serving.telemetry
        assert telemetry.enabled and telemetry.prometheus_host == "0.0.0.0"
        assert ports["metrics"] == telemetry.prometheus_port
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(telemetry.prometheus_port)
        service = services[name]
        assert service["spec"]["clusterIP"] == "None", "headless: clients balance over the pods"
        assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
        for port in service["spec"]["ports"]:
            assert ports[port["targetPort"]] == port["port"]
        grpc_service = getattr(importlib.import_module(service_constant.split(":")[0]), service_constant.split(":")[1])
        assert docker["healthcheck_service"] == grpc_service
        for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[probe_name]
            if "grpc" in probe:
                assert not serving.tls_cert_file, f"{probe_name}: the kubelet's gRPC probe cannot speak TLS"
                assert probe["grpc"]["port"] == serving.port
                assert probe["grpc"].get("service", "") in ({grpc_service} if probe_name != "livenessProbe"
                                                             else {"", grpc_service})
            else:
                command = probe["exec"]["command"]
                assert command[:2] == ["calibrl", "health"]
                assert command[command.index("--target") + 1] == f"localhost:{serving.port}"
                assert command[command.index("--tls-ca") + 1].startswith("/etc/calibrl/tls/")
                if probe_name != "livenessProbe":
                    assert command[command.index("--service") + 1] == grpc_service
                _check_health_flags(command[2:])

        # Paths: every file the config names is on a mounted volume, inputs read-only.
        mounts = _mounts(container, pod)
        inputs = [config.index_dir] if name == "retrieval" else [config.rubrics]
        if name == "judge" and config.judge.backend.startswith(("vllm:", "transformers:")):
            inputs.append(config.judge.backend.split(":", 1)[1])
        for path in inputs:
            _under(path, mounts, read_only=True)
        _, keys_volume = _under(serving.api_keys_file, mounts, read_only=True)
        assert keys_volume["secret"]["secretName"] == "calibrl-api-keys"
        for path in (serving.tls_cert_file, serving.tls_key_file):
            if path:
                _, tls_volume = _under(path, mounts, read_only=True)
                assert tls_volume["secret"]["secretName"] == "calibrl-tls"
        assert overlay.endswith("+tls") == bool(serving.tls_cert_file)
        _under("/tmp", mounts, read_only=False)  # the root filesystem is read-only

        # Non-root, as the Dockerfile's USER; terminationGracePeriodSeconds above drain + grace.
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == docker["user"]
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] and not context["allowPrivilegeEscalation"]
        assert context["capabilities"]["drop"] == ["ALL"]
        assert pod["terminationGracePeriodSeconds"] > _drain_delay_s(serving) + serving.grace_seconds

        # PDB and HPA point at this Deployment.
        pdb = _one(objects, "PodDisruptionBudget", name)
        assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
        hpa = _one(objects, "HorizontalPodAutoscaler", name)
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}

    # The NetworkPolicy admits the trainer's namespace to the gRPC ports, Prometheus to /metrics.
    policy = _one(objects, "NetworkPolicy", "calibrl-services")
    rules = {rule["from"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]:
             [p["port"] for p in rule["ports"]] for rule in policy["spec"]["ingress"]}
    assert rules == {TRAINER_NAMESPACE: ["grpc"], "monitoring": ["metrics"]}
    for deployment in (o for o in objects if o["kind"] == "Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()


def _check_health_flags(arguments: list[str]) -> None:
    """Every flag of a probe's `calibrl health ...` command is one `calibrl health` has."""
    flags = [a for a in arguments if a.startswith("--")]
    done = subprocess.run([sys.executable, "-m", "calibrl", "health", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    help_text = done.stdout
    for flag in flags:
        assert flag in help_text, f"calibrl health has no {flag}"


def _trainer_pods() -> list[tuple[str, dict, dict]]:
    job = _one(build(K8S / "trainer"), "Job", "calibrl-train")
    pods = [("job", job["spec"]["template"]["spec"], job)]
    pytorchjob = _pytorchjob()
    for role, spec in pytorchjob["spec"]["pytorchReplicaSpecs"].items():
        pods.append((f"pytorchjob-{role}", spec["template"]["spec"], pytorchjob))
    return pods


@pytest.mark.parametrize("which", ["job", "pytorchjob-Master", "pytorchjob-Worker"])
def test_trainer_manifests_match_the_train_cli_the_dockerfile_and_the_services(which, monkeypatch):
    import calibrl.trainer.config
    from calibrl.trainer import cli as trainer_cli
    from calibrl.trainer.config import TrainConfig

    kind, pod, owner = next(p for p in _trainer_pods() if p[0] == which)
    (container,) = pod["containers"]
    docker = _dockerfile("trainer")
    if which == "job":
        assert "command" not in container and docker["entrypoint"] == ["calibrl", "train"]
        assert _compose_images()[container["image"]]["dockerfile"] == "trainer"
    else:
        # torchrun -m calibrl.cli train: the same CLI, one process per GPU.
        assert container["command"][-3:] == ["-m", "calibrl.cli", "train"]
        done = subprocess.run([sys.executable, "-m", "calibrl.cli", "train", "--help"], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0 and "usage: calibrl train" in done.stdout
    config_file, overrides = _cli_config(monkeypatch, calibrl.trainer.config, "load_train_config",
                                         lambda: trainer_cli.train(list(container["args"])))
    config = _config_from_overrides(TrainConfig, list(overrides))
    mounts = _mounts(container, pod)
    _, config_volume = _under(config_file, mounts, read_only=True)
    assert config_volume["configMap"]["name"] == "calibrl-train-config"
    _under(config.policy.path, mounts, read_only=True)
    _, runs_volume = _under(config.output_dir, mounts, read_only=False)
    assert runs_volume["persistentVolumeClaim"]["claimName"] == "calibrl-runs"
    _under("/tmp", mounts, read_only=False)
    # The service targets are the headless Services of the overlays, in their namespace, on their ports.
    services = {o["metadata"]["name"]: o for o in _render("cpu") if o["kind"] == "Service"}
    for target, name in ((config.services.retrieval, "retrieval"), (config.services.judge, "judge")):
        service = services[name]
        grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
        assert target == f"dns:///{name}.{service['metadata']['namespace']}.svc.cluster.local:{grpc_port}"
    env = {e["name"]: e for e in container["env"]}
    assert env["CALIBRL_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "calibrl-trainer-key"
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == docker["user"]
    assert container["securityContext"]["readOnlyRootFilesystem"]
    assert pod["terminationGracePeriodSeconds"] >= 60, "time to write a checkpoint on SIGTERM"
    assert owner["metadata"].get("namespace", TRAINER_NAMESPACE) == TRAINER_NAMESPACE
