"""requirements/lock.txt (what `make install` installs and CI tests) satisfies pyproject.toml."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def lock():
    spec = importlib.util.spec_from_file_location("calibrl_lock_script", ROOT / "scripts" / "lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_lock_satisfies_every_requirement_of_pyproject(lock):
    pins = lock.read_lock()
    problems = lock.unsatisfied(pins, lock.requirements())
    assert problems == [], "requirements/lock.txt is stale; rerun: python scripts/lock.py\n" + "\n".join(problems)
    # CI's torch is the pinned CPU release the Makefile installs, and the dev tools are pinned too.
    assert {"torch", "pytest", "trl", "peft", "grpcio-tools", "packaging"} <= set(pins)


def test_the_check_fails_on_a_stale_lock(lock):
    groups = {"": ["numpy>=1.26", "torch>=2.4"], "dev": ["pytest>=8"], "otlp": ["opentelemetry-exporter-otlp>=1.25"],
              "gpu": ["vllm>=0.6"]}
    pins = {"numpy": "1.25.0", "torch": "2.13.0", "opentelemetry-exporter-otlp": "1.0"}
    problems = lock.unsatisfied(pins, groups)
    assert any(p.startswith("numpy==1.25.0 in the lock does not satisfy dependencies") for p in problems)
    assert any(p.startswith("pytest (optional-dependencies.dev") and "not in the lock" in p for p in problems)
    assert any("opentelemetry-exporter-otlp==1.0" in p and "optional-dependencies.otlp" in p for p in problems)
    assert not any("vllm" in p for p in problems)  # another extra's package that is not locked is not required
    assert len(problems) == 3


def test_lock_names_are_normalised_and_malformed_lines_are_named(lock, tmp_path):
    path = tmp_path / "lock.txt"
    path.write_text("# header\nPyYAML==6.0.4\ntyping_extensions==4.16.0  # comment\n")
    assert lock.read_lock(path) == {"pyyaml": "6.0.4", "typing-extensions": "4.16.0"}
    assert lock.unsatisfied(lock.read_lock(path), {"": ["pyyaml>=6.0", "typing-extensions>=4"]}) == []
    path.write_text("numpy>=1.26\n")
    with pytest.raises(ValueError, match=r"lock.txt:1: 'numpy>=1.26' is not NAME==VERSION"):
        lock.read_lock(path)


def test_the_makefile_installs_with_the_lock():
    makefile = (ROOT / "Makefile").read_text()
    install_lines = [line for line in makefile.splitlines() if "pip install" in line and "--upgrade pip" not in line]
    assert install_lines and all("-c $(LOCK)" in line for line in install_lines), install_lines
    assert "LOCK ?= requirements/lock.txt" in makefile
