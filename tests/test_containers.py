"""The images for real: built from this tree, run as a user would run them, called from the host.

The ``containers`` tests need podman (or docker) and opt in with CALIBRL_CONTAINER_TESTS=1
(CI runs them as their own step after the rest of the suite: ``.ci/run``); elsewhere they
are skipped with the reason. They build the images with scripts/build-images.sh (or reuse
images whose label ``io.calibrl.source-hash`` matches this tree), make a small index, a
validated rubric and a tiny policy with calibrl's own code on the host, start both
services as uid 10001 with a read-only root and read-only mounts, wait for health through
the images' own HEALTHCHECK command, call both services with calibrl's gRPC clients, let
the trainer container train two steps against them and check its checkpoint on the
volume, then stop the services with SIGTERM and check the drain and the exit codes.
Every container, volume and network the test makes is removed, pass or fail.

The tests of the build helpers (scripts/image_build_inputs.py, docker/requirements.py)
need no container engine and always run.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import time
import tomllib
import uuid

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
SERVICES = ("retrieval", "judge", "trainer")
TAG = os.environ.get("CALIBRL_IMAGE_TAG", "cpu")
TEST_LABEL = "io.calibrl.test=containers"
RUBRIC_ID = "funds"
DRAIN_S = 10.0  # serving.drain_seconds in the test: long enough to observe NOT_SERVING on a loaded host
BUILD_TIMEOUT_S = 2700  # a cold build of all four images on 2 busy cores (measured: 469 s)
HEALTH_TIMEOUT_S = 600
TRAIN_TIMEOUT_S = 1200
# pytest-timeout counts fixture set-up: the first test may build every image from scratch.
CONTAINER_TEST_TIMEOUT_S = BUILD_TIMEOUT_S + HEALTH_TIMEOUT_S * 2 + TRAIN_TIMEOUT_S


def _load_script(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_inputs = _load_script("calibrl_image_build_inputs", ROOT / "scripts" / "image_build_inputs.py")
image_requirements = _load_script("calibrl_image_requirements", ROOT / "docker" / "requirements.py")


# =============================================================================== build helpers (no engine)


def test_base_and_trainer_layers_together_install_every_dependency_once():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    training_only = {"matplotlib", "tensorboard"}
    base = image_requirements.requirement_lines(pyproject, without=training_only)
    trainer = image_requirements.requirement_lines(pyproject, only=training_only, extras=["lora"])
    core = pyproject["project"]["dependencies"]
    assert sorted(base + trainer[:2]) == sorted(core) and not set(base) & set(trainer)
    assert not any(line.startswith(("matplotlib", "tensorboard", "peft")) for line in base)
    assert trainer[2:] == pyproject["project"]["optional-dependencies"]["lora"]
    with pytest.raises(SystemExit, match="--extras nope: not an extra"):
        image_requirements.requirement_lines(pyproject, extras=["nope"])


def test_build_pip_config_keeps_what_means_the_same_in_a_build_and_drops_host_paths(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    ca = tmp_path / "corp-ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    listing = "\n".join([
        "global.index-url='https://user:token@mirror.example/simple'",
        f"global.cert='{ca}'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.extra-index-url='file:///opt/pypi/simple https://extra.example/simple'",
        "global.trusted-host='mirror.example'",
        "install.no-compile='0'",
        f":env:.find-links='{wheels}'",
        ":env:.default-timeout='180'",
    ])
    config = build_inputs.build_config(build_inputs.parse_config_list(listing), {})
    assert config["ca_bundle"] == str(ca) and config["wheelhouse"] == str(wheels)
    assert config["sections"] == {
        "global": {"index-url": "https://user:token@mirror.example/simple",
                   "extra-index-url": "https://extra.example/simple", "trusted-host": "mirror.example",
                   "default-timeout": "180"},
        "install": {"no-compile": "0"},
    }
    assert sorted(config["dropped"]) == ["global.cert", "global.constraint",
                                         "global.extra-index-url=file:///opt/pypi/simple"]
    text = build_inputs.render_pip_conf(config["sections"])
    assert "[global]\nindex-url = https://user:token@mirror.example/simple\n" in text and str(tmp_path) not in text
    # No cert option: the CA bundle comes from the usual variables; a missing file is reported, not passed.
    config = build_inputs.build_config({}, {"REQUESTS_CA_BUNDLE": str(tmp_path / "missing.pem")})
    assert config["ca_bundle"] == "" and config["dropped"] == [f"cert={tmp_path / 'missing.pem'} (no such file)"]


def test_source_hash_follows_the_files_the_images_are_built_from(tmp_path):
    for name in ("pyproject.toml", "calibrl/a.py", "calibrl/__pycache__/a.cpython-311.pyc"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    first = build_inputs.source_hash(tmp_path, ("pyproject.toml", "calibrl"))
    (tmp_path / "calibrl/__pycache__/a.cpython-311.pyc").write_text("other bytecode")
    assert build_inputs.source_hash(tmp_path, ("pyproject.toml", "calibrl")) == first
    (tmp_path / "calibrl/a.py").write_text("changed")
    assert build_inputs.source_hash(tmp_path, ("pyproject.toml", "calibrl")) != first


def test_saved_models_are_readable_by_other_users_as_the_umask_allows(tmp_path):
    """safetensors writes 0600; calibrl's save sites give model files the umask's mode, so
    uid 10001 in a container can read a policy saved on the host (and the reverse)."""
    from calibrl.fileperms import current_umask, honour_umask
    from calibrl.testing import save_tiny_policy

    assert current_umask() == 0o022, "these checks assume the usual umask 022"
    policy = save_tiny_policy(tmp_path / "policy")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in policy.iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes
    private = tmp_path / "private"
    private.mkdir()
    (private / "weights.bin").touch(mode=0o600)
    (private / "wide.bin").touch()
    (private / "wide.bin").chmod(0o775)
    honour_umask(private)
    assert stat.S_IMODE((private / "weights.bin").stat().st_mode) == 0o644
    assert stat.S_IMODE((private / "wide.bin").stat().st_mode) == 0o775  # nothing is taken away


# =============================================================================== the engine and the images


def _engine() -> str:
    if os.environ.get("CALIBRL_CONTAINER_TESTS") != "1":
        pytest.skip("container tests opt in: CALIBRL_CONTAINER_TESTS=1 (CI runs them after the suite)")
    for name in ("podman", "docker"):
        if shutil.which(name):
            return name
    pytest.skip("neither podman nor docker is installed")


@pytest.fixture(scope="module")
def engine():
    """podman (with the project's containers.conf, as scripts/podman-env.sh sets it) or docker."""
    name = _engine()
    previous = os.environ.get("CONTAINERS_CONF")
    if name == "podman":
        os.environ["CONTAINERS_CONF"] = str(ROOT / "docker" / "podman" / "containers.conf")
    yield name
    if previous is None:
        os.environ.pop("CONTAINERS_CONF", None)
    else:
        os.environ["CONTAINERS_CONF"] = previous


def _rm(engine: str, container: str) -> None:
    now = ["--time", "0"] if engine == "podman" else []  # docker rm --force kills at once anyway
    _run(engine, "rm", "--force", *now, container, check=False, timeout=120)


def _run(engine: str, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([engine, *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{engine} {' '.join(args)} -> {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def _inspect(engine: str, image: str) -> dict:
    return json.loads(_run(engine, "image", "inspect", image).stdout)[0]


def _label(engine: str, image: str) -> str | None:
    result = _run(engine, "image", "inspect", "--format", "{{json .Config.Labels}}", image, check=False)
    if result.returncode != 0:
        return None
    return (json.loads(result.stdout) or {}).get("io.calibrl.source-hash")


@pytest.fixture(scope="module")
def images(engine: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """``{service: image}``, built from this tree unless images with its source hash exist."""
    names = {service: f"calibrl-{service}:{TAG}" for service in ("base", *SERVICES)}
    wanted = build_inputs.source_hash()
    if all(_label(engine, names[service]) == wanted for service in SERVICES):
        return names
    log = tmp_path_factory.mktemp("build") / "build.log"
    env = dict(os.environ, ENGINE=engine, TAG=TAG)
    with log.open("w") as out:
        result = subprocess.run(["bash", str(ROOT / "scripts" / "build-images.sh")], stdout=out,
                                stderr=subprocess.STDOUT, env=env, timeout=BUILD_TIMEOUT_S, cwd=ROOT)
    if result.returncode != 0:
        pytest.fail(f"scripts/build-images.sh failed ({result.returncode}):\n{log.read_text()[-6000:]}")
    assert all(_label(engine, names[service]) == wanted for service in SERVICES)
    return names


@pytest.mark.containers
@pytest.mark.timeout(CONTAINER_TEST_TIMEOUT_S)
def test_images_share_the_base_and_run_as_uid_10001(engine, images):
    base_layers = _inspect(engine, images["base"])["RootFS"]["Layers"]
    for service in SERVICES:
        info = _inspect(engine, images[service])
        assert info["RootFS"]["Layers"][:len(base_layers)] == base_layers, f"{service} is not built on the base"
        assert info["Config"]["User"] == "10001", service
    for service, port in (("retrieval", "50051"), ("judge", "50052")):
        test = _healthcheck(engine, images[service])
        assert test[:4] == ["CMD", "calibrl", "health", "--target"] and test[4] == f"127.0.0.1:{port}", test
    # Each service image carries what it runs: no training stack in the servers, no compilers anywhere.
    probe = ("import importlib.util as u, shutil; "
             "print(sorted(m for m in ('matplotlib', 'tensorboard', 'peft') if u.find_spec(m)), "
             "[c for c in ('gcc', 'cc', 'g++') if shutil.which(c)])")
    for service, training in (("retrieval", []), ("judge", []), ("trainer", ["matplotlib", "peft", "tensorboard"])):
        out = _run(engine, "run", "--rm", "--entrypoint", "python", images[service], "-c", probe).stdout
        assert out.strip() == f"{training} []", f"{service}: {out}"


def _healthcheck(engine: str, image: str) -> list[str]:
    info = _inspect(engine, image)
    # podman puts it at the top level of `image inspect`, docker under Config
    check = info.get("Healthcheck") or info["Config"].get("Healthcheck") or {}
    return list(check.get("Test") or [])


def _host_extra_certificates() -> set[str]:
    """PEM blocks of this machine's CA bundle that Debian's own bundle lacks (a mirror's CA)."""
    host = pathlib.Path(os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt")
    if not host.is_file():
        return set()
    return {block.strip() for block in host.read_text().split("-----END CERTIFICATE-----") if "BEGIN" in block}


@pytest.mark.containers
@pytest.mark.timeout(CONTAINER_TEST_TIMEOUT_S)
def test_no_build_secret_or_pip_configuration_is_left_in_any_image(engine, images):
    host_certs = _host_extra_certificates()
    probe = r"""
import glob, json, os, pathlib, subprocess, sys
found = [p for pattern in ('/etc/pip.conf', '/etc/xdg/pip/*', '/root/.pip/*', '/root/.config/pip/*',
                           '/usr/local/pip.conf', '/run/secrets/*', '/wheelhouse/*', '/tmp/calibrl-deps')
         for p in glob.glob(pattern)]
listing = subprocess.run([sys.executable, '-m', 'pip', 'config', 'list'], capture_output=True, text=True).stdout
config = [line for line in listing.splitlines() if not line.startswith(':env:')]  # the image's own ENV
bundles = ['/etc/ssl/certs/ca-certificates.crt'] + glob.glob('/usr/local/lib/python3*/site-packages/certifi/cacert.pem')
blocks = set()
for bundle in bundles:
    text = pathlib.Path(bundle).read_text()
    blocks |= {b.strip() for b in text.split('-----END CERTIFICATE-----') if 'BEGIN' in b}
print(json.dumps({'found': found, 'config': config, 'env': sorted(k for k in os.environ if k.startswith('PIP_')),
                  'blocks': sorted(blocks)}))
"""
    for name, image in images.items():
        report = json.loads(_run(engine, "run", "--rm", "--user", "0", "--entrypoint", "python", image,
                                 "-c", probe).stdout)
        assert report["found"] == [] and report["config"] == [], f"{name}: {report['found']} {report['config']}"
        assert set(report["env"]) <= {"PIP_NO_CACHE_DIR", "PIP_DISABLE_PIP_VERSION_CHECK"}, report["env"]
        image_certs = set(report["blocks"])
        debian_like = host_certs & image_certs
        leaked = [c for c in host_certs - debian_like if c in image_certs]
        assert leaked == [], f"{name}: the host's own CA certificates were baked into the image"
        history = _run(engine, "history", "--no-trunc", "--format", "{{.CreatedBy}}", image).stdout
        for secret_text in ("PIP_CONFIG_FILE=/", "index-url =", "BEGIN CERTIFICATE"):
            assert secret_text not in history.replace("PIP_CONFIG_FILE=/run/secrets/pip_conf", ""), name
        for line in history.splitlines():
            assert not ("COPY" in line and ("pip.conf" in line or ".pem" in line)), f"{name}: {line}"


# =============================================================================== the running stack


class Stack:
    """Names of everything one test run creates, removed by :meth:`remove` whatever happened."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        suffix = uuid.uuid4().hex[:8]
        self.network = f"calibrl-test-{suffix}"
        self.volume = f"calibrl-test-runs-{suffix}"
        self.containers = {name: f"calibrl-test-{name}-{suffix}" for name in SERVICES}

    def remove(self) -> None:
        for name in self.containers.values():
            _rm(self.engine, name)
        _run(self.engine, "volume", "rm", "--force", self.volume, check=False, timeout=120)
        _run(self.engine, "network", "rm", "--force", self.network, check=False, timeout=120)


def _remove_leftovers(engine: str) -> None:
    """Containers of an earlier run of this test that was killed before its own clean-up."""
    listed = _run(engine, "ps", "--all", "--filter", f"label={TEST_LABEL}", "--format", "{{.Names}}", check=False)
    for name in listed.stdout.split():
        if name.startswith("calibrl-test-"):
            _rm(engine, name)


@pytest.fixture
def stack(engine: str):
    _remove_leftovers(engine)
    created = Stack(engine)
    try:
        yield created
    finally:
        created.remove()


def _make_world(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Index, validated rubric, tiny policy, tasks and the trainer config, made by calibrl on the host."""
    import contextlib
    import io

    from calibrl.embedding import SentenceEmbedder
    from calibrl.judge_server import cli as judge_cli
    from calibrl.judge_server.authoring.feedback import write_feedback
    from calibrl.testing import SYNTHETIC_GLOSSARY, TINY_CORPUS, build_test_index, save_tiny_policy, synthetic_feedback

    root.chmod(0o755)  # pytest makes its folders 0700; what calibrl writes inside keeps its own modes
    world = {"policy": save_tiny_policy(root / "policy"),
             "index": build_test_index(root / "index", embedder=SentenceEmbedder(None, device="cpu"),
                                       show_progress=False),
             "rubrics": root / "rubrics", "tasks": root / "rewrite.jsonl", "config": root / "train.yaml"}
    work = root / "judge-work"
    work.mkdir()
    write_feedback(work / "feedback.jsonl", synthetic_feedback(200, seed=0))
    (work / "glossary.txt").write_text("\n".join(SYNTHETIC_GLOSSARY) + "\n")
    world["rubrics"].mkdir()
    rubric, golden = world["rubrics"] / f"{RUBRIC_ID}.yaml", work / "golden.jsonl"
    with contextlib.redirect_stdout(io.StringIO()):
        assert judge_cli.distill(["--feedback", str(work / "feedback.jsonl"), "--out", str(rubric), "--golden-out",
                                  str(golden), "--id", RUBRIC_ID, "--criteria", "programmatic",
                                  "--glossary", str(work / "glossary.txt")]) == 0
        assert judge_cli.validate(["--rubric", str(rubric), "--golden", str(golden), "--judge", "programmatic"]) == 0
    world["tasks"].write_text("".join(json.dumps({"id": p["_id"], "query": f"tell me about {p['title'].lower()}",
                                                  "gold_doc_ids": [p["_id"]]}) + "\n" for p in TINY_CORPUS))
    config = {"policy": {"path": "/models/policy", "device": "cpu"}, "tasks": {"path": "/data/rewrite.jsonl"},
              "reward": {"rubric_id": RUBRIC_ID},
              "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 6},
              "optimizer": {"lr": 0.001}, "steps": 2, "output_dir": "/runs/train", "progress_bar": False}
    world["config"].write_text(yaml.safe_dump(config))
    return world


def _unreadable_by_others(paths) -> list[str]:
    """Files without o+r and folders without o+rx under ``paths``: uid 10001 could not read them."""
    bad = []
    for top in paths:
        for path in [top, *top.rglob("*")] if top.is_dir() else [top]:
            mode = path.stat().st_mode
            need = stat.S_IROTH | stat.S_IXOTH if path.is_dir() else stat.S_IROTH
            if mode & need != need:
                bad.append(f"{path} {stat.filemode(mode)}")
    return bad


def _start_service(engine: str, stack: Stack, images: dict[str, str], service: str, mounts: list[str],
                   args: list[str], port: int) -> None:
    run = [engine, "run", "--detach", "--name", stack.containers[service], "--label", TEST_LABEL,
           "--network", stack.network, "--network-alias", service, "--read-only", "--user", "10001:10001",
           "--publish", f"127.0.0.1::{port}", "--stop-timeout", "60", "--env", "OMP_NUM_THREADS=1"]
    for mount in mounts:
        run += ["--volume", mount]
    subprocess.run(run + [images[service], *args], check=True, capture_output=True, timeout=300)


def _healthy(engine: str, container: str, image: str) -> bool:
    """One health check with the image's own HEALTHCHECK command (podman healthcheck run / docker exec)."""
    if engine == "podman":
        return _run(engine, "healthcheck", "run", container, check=False, timeout=120).returncode == 0
    command = _healthcheck(engine, image)[1:]
    return _run(engine, "exec", container, *command, check=False, timeout=120).returncode == 0


def _wait_healthy(engine: str, stack: Stack, images: dict[str, str], service: str) -> float:
    container, started = stack.containers[service], time.monotonic()
    while time.monotonic() - started < HEALTH_TIMEOUT_S:
        if _healthy(engine, container, images[service]):
            return time.monotonic() - started
        state = _run(engine, "inspect", "--format", "{{.State.Status}}", container).stdout.strip()
        assert state == "running", f"{service} {state}:\n{_logs(engine, container)}"
        time.sleep(3)
    raise AssertionError(f"{service} not healthy after {HEALTH_TIMEOUT_S} s:\n{_logs(engine, container)}")


def _logs(engine: str, container: str) -> str:
    result = _run(engine, "logs", container, check=False)
    return (result.stdout + result.stderr)[-4000:]


def _host_port(engine: str, container: str, port: int) -> str:
    published = _run(engine, "port", container, str(port)).stdout.split()[0]
    return "127.0.0.1:" + published.rsplit(":", 1)[1]


async def _call_both(retrieval_target: str, judge_target: str) -> tuple[list, list, list]:
    from calibrl.api.judge import JudgeItem
    from calibrl.trainer.grpc_clients import GrpcJudgeClient, GrpcRetrievalClient

    retrieval, judge = GrpcRetrievalClient(retrieval_target, timeout_s=60), GrpcJudgeClient(judge_target, timeout_s=60)
    try:
        hits = await retrieval.search(["Who discovered penicillin?"], top_k=3)
        rubrics = await judge.list_rubrics()
        item = JudgeItem.make("vtsax expense ratio", "What is the expense ratio of the VTSAX fund?")
        scores = await judge.score(RUBRIC_ID, [item])
    finally:
        await retrieval.close()
        await judge.close()
    return hits, rubrics, scores


def _volume_path(engine: str, volume: str) -> pathlib.Path:
    return pathlib.Path(_run(engine, "volume", "inspect", "--format", "{{.Mountpoint}}", volume).stdout.strip())


def _stop_and_check_drain(engine: str, stack: Stack, service: str, host_target: str) -> None:
    """SIGTERM: health turns NOT_SERVING at once, the server drains DRAIN_S seconds, then exits 0."""
    from calibrl.healthcheck import check

    container = stack.containers[service]
    sent = time.monotonic()
    _run(engine, "kill", "--signal", "TERM", container)
    statuses = []
    while time.monotonic() - sent < DRAIN_S - 1.0 and "NOT_SERVING" not in statuses:
        try:
            statuses.append(check(host_target, timeout_s=2.0))
        except Exception as error:  # noqa: BLE001 - recorded: the server must still answer here
            statuses.append(type(error).__name__)
        time.sleep(0.2)
    waited = _run(engine, "wait", container, timeout=300).stdout.strip()
    elapsed = time.monotonic() - sent
    logs = _logs(engine, container)
    assert statuses[-1] == "NOT_SERVING", f"{service} health during the drain: {statuses}"
    assert waited == "0", f"{service} exited {waited}:\n{logs}"
    assert f"NOT_SERVING; still serving for the {DRAIN_S}s drain delay" in logs, logs
    assert elapsed >= DRAIN_S - 1.0, f"{service} stopped after {elapsed:.1f} s, before its {DRAIN_S} s drain"


@pytest.mark.containers
@pytest.mark.timeout(CONTAINER_TEST_TIMEOUT_S)
def test_services_and_trainer_run_in_their_containers(engine, images, stack, tmp_path):
    from calibrl.trainer import checkpoint as ckpt

    started = time.monotonic()
    world = _make_world(tmp_path)
    assert _unreadable_by_others([world[k] for k in ("policy", "index", "rubrics", "tasks", "config")]) == []
    _run(engine, "network", "create", stack.network)
    _run(engine, "volume", "create", stack.volume)

    drain = f"serving.drain_seconds={DRAIN_S}"
    _start_service(engine, stack, images, "retrieval", [f"{world['index']}:/index:ro"],
                   ["--index", "/index", "--port", "50051", "serving.host=0.0.0.0", drain], 50051)
    _start_service(engine, stack, images, "judge", [f"{world['rubrics']}:/rubrics:ro"],
                   ["--rubrics", "/rubrics", "--backend", "programmatic", "--port", "50052",
                    "serving.host=0.0.0.0", drain], 50052)
    # The trainer starts with the services, as podman-compose starts it on a host without a
    # health-check daemon: it must wait for them itself (retries on UNAVAILABLE).
    trainer = [engine, "run", "--detach", "--name", stack.containers["trainer"], "--label", TEST_LABEL,
               "--network", stack.network, "--read-only", "--user", "10001:10001", "--env", "OMP_NUM_THREADS=1",
               "--volume", f"{world['policy']}:/models/policy:ro",
               "--volume", f"{world['config']}:/etc/calibrl/train.yaml:ro",
               "--volume", f"{world['tasks']}:/data/rewrite.jsonl:ro",
               "--volume", f"{stack.volume}:/runs", images["trainer"],
               "--config", "/etc/calibrl/train.yaml", "services.retrieval=retrieval:50051",
               "services.judge=judge:50052", "services.max_attempts=60"]
    subprocess.run(trainer, check=True, capture_output=True, timeout=300)

    for service in ("retrieval", "judge"):
        _wait_healthy(engine, stack, images, service)
        container = stack.containers[service]
        assert _run(engine, "exec", container, "id", "-u").stdout.strip() == "10001"
        # a read-only root file system and read-only mounts
        denied = _run(engine, "exec", container, "sh", "-c", "touch /usr/x 2>&1; touch /index/x /rubrics/x 2>&1",
                      check=False).stdout
        assert denied.count("Read-only file system") == 2, denied

    # Both services from the host, through calibrl's own gRPC clients.
    targets = {service: _host_port(engine, stack.containers[service], port)
               for service, port in (("retrieval", 50051), ("judge", 50052))}
    hits, rubrics, scores = asyncio.run(_call_both(targets["retrieval"], targets["judge"]))
    assert hits[0][0].doc_id == "penicillin"
    assert [(r["id"], r["validated"]) for r in rubrics] == [(RUBRIC_ID, True)]
    assert 0.8 < scores[0].total <= 1.0

    # The trainer: two GRPO steps against both containers, its checkpoint on the volume.
    exit_code = _run(engine, "wait", stack.containers["trainer"], timeout=TRAIN_TIMEOUT_S).stdout.strip()
    assert exit_code == "0", _logs(engine, stack.containers["trainer"])
    trainer_log = _run(engine, "logs", stack.containers["trainer"]).stderr
    print(f"trainer: {trainer_log.count('retrying')} calls retried while the services started", file=sys.stderr)
    run_dir = _volume_path(engine, stack.volume) / "train"
    checkpoint = ckpt.find_checkpoint(run_dir)
    assert ckpt.load_train_state(checkpoint).step == 2
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(0.0 <= m["reward"] <= 1.0 for m in metrics)
    assert _unreadable_by_others([run_dir]) == []

    for service in ("retrieval", "judge"):
        _stop_and_check_drain(engine, stack, service, targets[service])
    print(f"container test wall time (without the image build): {time.monotonic() - started:.0f} s", file=sys.stderr)
