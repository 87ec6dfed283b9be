"""``from calibrl import ...``: every public name resolves to its defining object, lazily."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import calibrl


def test_every_exported_name_resolves_to_its_definition():
    import importlib

    for name in calibrl.__all__:
        if name == "__version__":
            continue
        value = getattr(calibrl, name)
        module = importlib.import_module(calibrl._EXPORTS[name])
        assert value is getattr(module, name), name
    from calibrl.trainer.loop import train

    assert calibrl.train is train


def test_an_unknown_name_is_an_attribute_error():
    try:
        calibrl.NotAThing  # noqa: B018
    except AttributeError as exc:
        assert "NotAThing" in str(exc)
    else:
        raise AssertionError("calibrl.NotAThing did not raise")


def test_importing_calibrl_loads_no_heavy_module():
    code = ("import sys, calibrl; from calibrl import TrainConfig, load_train_config; "
            "print(sorted(m for m in ('torch', 'faiss', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_distribution_installs_only_under_the_calibrl_namespace(tmp_path):
    """trainer/, judge_server/ and retrieval_server/ install as calibrl.trainer, ...: no
    generic top-level import name is claimed, and no subpackage is left out of the wheel."""
    import tomllib

    root = pathlib.Path(__file__).resolve().parent.parent
    setuptools_table = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(setuptools_table["packages"])
    assert all(p == "calibrl" or p.startswith("calibrl.") for p in packages)
    for name, folder in setuptools_table["package-dir"].items():
        for init in (root / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(root / folder).parts
            assert ".".join((name, *relative)) in packages, f"{init.parent} is not packaged"
    # Outside the repository only the calibrl names import.
    probe = ("import importlib.util as u; import calibrl.trainer.loop, calibrl.judge_server.judge, "
             "calibrl.retrieval_server.retriever; "
             "print([n for n in ('trainer', 'judge_server', 'retrieval_server') if u.find_spec(n)])")
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
