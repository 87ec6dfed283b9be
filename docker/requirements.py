"""Print requirement lines for one layer of calibrl's images, read from pyproject.toml.

The shared base image installs the dependencies every image runs (--without the ones only
training uses); the trainer image adds those (--only) and its extras. One source of truth:
the dependency list in pyproject.toml, with versions from requirements/lock.txt as constraints.

    python docker/requirements.py pyproject.toml --without matplotlib,tensorboard
    python docker/requirements.py pyproject.toml --only matplotlib,tensorboard --extras lora
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def requirement_lines(pyproject: dict, *, only: set[str] | None = None, without: set[str] = frozenset(),
                      extras: list[str] = ()) -> list[str]:
    """Core dependencies filtered by name (``only`` keeps, ``without`` drops), then the extras' lists."""
    project = pyproject["project"]
    lines = [r for r in project["dependencies"]
             if (only is None or _name(r) in only) and _name(r) not in without]
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise SystemExit(f"--extras {extra}: not an extra of pyproject.toml (have: {', '.join(sorted(optional))})")
        lines.extend(optional[extra])
    return lines


def _names(text: str) -> set[str]:
    return {_name(part) for part in text.split(",") if part.strip()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject")
    parser.add_argument("--only", default=None, help="comma-separated names to keep")
    parser.add_argument("--without", default="", help="comma-separated names to drop")
    parser.add_argument("--extras", default="", help="comma-separated extras to add")
    args = parser.parse_args(argv)
    with open(args.pyproject, "rb") as handle:
        pyproject = tomllib.load(handle)
    only = None if args.only is None else _names(args.only)
    extras = [e.strip() for e in args.extras.split(",") if e.strip()]
    lines = requirement_lines(pyproject, only=only, without=_names(args.without), extras=extras)
    sys.stdout.write("".join(f"{line}\n" for line in lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
