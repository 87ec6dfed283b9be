"""Regenerate the committed Python stubs of proto/calibrl/v1 into calibrl/v1.

Run `python scripts/gen_proto.py` after editing a .proto; tests/test_proto_sync.py
fails while the committed stubs differ from what this script generates.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
STUB_DIR = ROOT / "calibrl" / "v1"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Generate *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every .proto into out_dir."""
    from grpc_tools import protoc  # dev extra only

    protos = sorted(PROTO_DIR.glob("calibrl/v1/*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_DIR)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")
    return sorted((out_dir / "calibrl" / "v1").glob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for generated in generate(pathlib.Path(tmp)):
            shutil.copyfile(generated, STUB_DIR / generated.name)
            print(f"wrote {STUB_DIR.relative_to(ROOT) / generated.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
