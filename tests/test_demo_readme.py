"""The README's demo section cannot drift: every command it shows uses real flags."""

from __future__ import annotations

import pathlib
import re

import pytest

from calibrl.cli import COMMANDS
from calibrl.cli import main as calibrl_main

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def demo_section() -> str:
    text = README.read_text(encoding="utf-8")
    return text[text.index("<!-- section:demo -->"):text.index("<!-- /section:demo -->")]


def test_demo_section_commands_use_real_flags(capsys) -> None:
    section = demo_section()
    blocks = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
    lines = " \n".join(blocks).replace("\\\n", " ").splitlines()
    commands = [line.split("#")[0].strip() for line in lines if line.strip().startswith("calibrl ")]
    seen = set()
    for command in commands:
        words = command.split()[1:]
        name = next(tuple(words[:n]) for n in (2, 1) if tuple(words[:n]) in COMMANDS)
        seen.add(name)
        with pytest.raises(SystemExit):
            calibrl_main([*name, "--help"])
        help_text = capsys.readouterr().out
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", command):
            assert flag in help_text, f"README demo section uses `calibrl {' '.join(name)} {flag}`"
    # the section walks the whole pipeline on real data, and the demo itself
    for name in (("demo",), ("index", "build"), ("serve", "retrieval"), ("serve", "judge"), ("rubric", "distill"),
                 ("rubric", "validate"), ("train",), ("eval",)):
        assert name in seen, f"README demo section shows no `calibrl {' '.join(name)}` command"
    assert "make demo" in section and "../shared/data/hotpotqa/dev_400.jsonl" in section
