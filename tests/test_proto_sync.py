"""The committed stubs in calibrl/v1 must equal what proto/ generates."""

import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import gen_proto  # noqa: E402


def test_committed_stubs_match_proto():
    with tempfile.TemporaryDirectory() as tmp:
        generated = gen_proto.generate(pathlib.Path(tmp))
        assert generated, "no stubs generated"
        for path in generated:
            committed = ROOT / "calibrl" / "v1" / path.name
            assert committed.exists(), f"{committed} missing: run python scripts/gen_proto.py"
            assert committed.read_bytes() == path.read_bytes(), (
                f"{committed.name} differs from proto/: run python scripts/gen_proto.py"
            )


def test_every_message_field_is_documented():
    """API docs live in the .proto: every field and rpc has a comment above it or a
    documented message around it."""
    for proto in (ROOT / "proto" / "calibrl" / "v1").glob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            if stripped.startswith("rpc "):
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1} rpc undocumented"
