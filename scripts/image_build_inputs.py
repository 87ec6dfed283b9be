"""What an image build needs from this machine, without putting any of it into a layer.

Two jobs for scripts/build-images.sh:

``pip`` turns this machine's pip configuration (``pip config list``: every config file plus
PIP_* variables) into files for the build's secrets, written to ``--out`` (a private folder):

- ``pip.conf``: the settings that mean the same inside a build (index-url, extra-index-url,
  trusted-host, proxy, timeouts, ...). Paths on this machine mean nothing there and are
  left out: ``cert`` (the CA bundle travels as its own secret), ``constraint`` and
  ``requirement`` files (the build uses requirements/lock.txt), ``file://`` indexes and
  local ``find-links`` folders (a local folder of wheels travels as the build context
  ``wheelhouse`` instead).
- the CA bundle's path: pip's ``cert``, else PIP_CERT, REQUESTS_CA_BUNDLE or SSL_CERT_FILE.

It prints shell assignments (PIP_CONF, CA_BUNDLE, WHEELHOUSE, and DROPPED: what was left
out, for the build log). Credentials in an index URL stay in pip.conf, which only the build's
secret mount reads.

``hash`` prints a digest of every file the images are built from (the Dockerfiles,
pyproject.toml, the lock, README.md and the four packages' sources); images carry it as the
label ``io.calibrl.source-hash`` so a test can reuse images built from the same tree.

    python scripts/image_build_inputs.py pip --out "$(mktemp -d)"
    python scripts/image_build_inputs.py hash
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import shlex
import subprocess
import sys
from typing import Iterable, Mapping

ROOT = pathlib.Path(__file__).resolve().parent.parent
# What COPY instructions in docker/*.Dockerfile read, plus the Dockerfiles themselves.
IMAGE_INPUTS = ("docker", "pyproject.toml", "README.md", "requirements/lock.txt",
                "calibrl", "retrieval_server", "judge_server", "trainer")
PATH_OPTIONS = {"cert", "client-cert", "constraint", "requirement", "build-constraint", "log", "cache-dir",
                "src", "target", "prefix", "root"}
CA_VARIABLES = ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE")


def parse_config_list(text: str) -> dict[str, dict[str, str]]:
    """``pip config list`` lines (``global.index-url='...'``, ``:env:.timeout='60'``) as
    ``{section: {key: value}}``; environment entries become section ``global`` and win."""
    sections: dict[str, dict[str, str]] = {}
    env: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, quoted = line.partition("=")
        if not sep or "." not in name:
            continue
        section, _, key = name.rpartition(".")
        value = " ".join(shlex.split(quoted)) if quoted.strip() else ""
        if section == ":env:":
            env[key] = value
        else:
            sections.setdefault(section, {})[key] = value
    sections.setdefault("global", {}).update(env)
    return sections


def _is_local(location: str) -> bool:
    return location.startswith(("file:", "/", ".", "~")) or "://" not in location


def build_config(sections: Mapping[str, Mapping[str, str]], environ: Mapping[str, str]) -> dict[str, object]:
    """The build's pip.conf sections, CA bundle, wheelhouse and what was dropped (see module doc)."""
    kept: dict[str, dict[str, str]] = {}
    dropped: list[str] = []
    wheelhouse = ""
    ca_bundle = ""
    for section, options in sections.items():
        for key, value in options.items():
            if key == "cert":
                ca_bundle = value
            if key in PATH_OPTIONS:
                dropped.append(f"{section}.{key}")
                continue
            if key in ("index-url", "extra-index-url", "find-links"):
                locations = value.split()
                remote = [loc for loc in locations if not _is_local(loc)]
                for loc in locations:
                    if not _is_local(loc):
                        continue
                    folder = loc.removeprefix("file://")
                    if key == "find-links" and not wheelhouse and os.path.isdir(folder):
                        wheelhouse = folder
                    else:
                        dropped.append(f"{section}.{key}={loc}")
                if not remote:
                    continue
                value = " ".join(remote)
            kept.setdefault(section, {})[key] = value
    if not ca_bundle:
        ca_bundle = next((environ[name] for name in CA_VARIABLES if environ.get(name)), "")
    if ca_bundle and not os.path.isfile(ca_bundle):
        dropped.append(f"cert={ca_bundle} (no such file)")
        ca_bundle = ""
    return {"sections": kept, "ca_bundle": ca_bundle, "wheelhouse": wheelhouse, "dropped": dropped}


def render_pip_conf(sections: Mapping[str, Mapping[str, str]]) -> str:
    lines = []
    for section, options in sections.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {value}" for key, value in options.items())
        lines.append("")
    return "\n".join(lines)


def source_hash(root: pathlib.Path = ROOT, inputs: Iterable[str] = IMAGE_INPUTS) -> str:
    """sha256 over the relative path and bytes of every input file (caches and bytecode skipped)."""
    digest = hashlib.sha256()
    for name in inputs:
        top = root / name
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for path in files:
            if "__pycache__" in path.parts or path.suffix == ".pyc":
                continue
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _pip_command(out: pathlib.Path) -> int:
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             check=True).stdout
    config = build_config(parse_config_list(listing), os.environ)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    pip_conf = out / "pip.conf"
    pip_conf.touch(mode=0o600)
    pip_conf.write_text(render_pip_conf(config["sections"]))
    assignments = {"PIP_CONF": str(pip_conf), "CA_BUNDLE": config["ca_bundle"],
                   "WHEELHOUSE": config["wheelhouse"], "DROPPED": " ".join(config["dropped"])}
    print("\n".join(f"{name}={shlex.quote(value)}" for name, value in assignments.items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    pip = commands.add_parser("pip", help="write the build's pip.conf and print the secrets' paths")
    pip.add_argument("--out", required=True, type=pathlib.Path, help="a private folder outside the build context")
    commands.add_parser("hash", help="print the digest of the files the images are built from")
    args = parser.parse_args(argv)
    if args.command == "pip":
        return _pip_command(args.out)
    print(source_hash())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
