"""``from calibrl import ...``: every public name resolves to its defining object, lazily."""

from __future__ import annotations

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
    from trainer.loop import train

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
