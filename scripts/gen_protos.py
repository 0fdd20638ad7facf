"""Regenerate the Python gRPC code from protos/ (the one command; never edit its output).

Usage: python scripts/gen_protos.py [--out DIR]

Generated modules land in pagedserve/<service>/v1/ next to the common package, so the imports that
grpcio-tools writes (``from pagedserve.memory.v1 import memory_pb2``) resolve without sys.path tricks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    """Run protoc for every .proto under protos/ into out_dir (raises on failure)."""
    import grpc_tools

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    for proto in proto_files():
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(proto),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto.relative_to(ROOT)}")
    for package_dir in {p.parent.relative_to(PROTO_ROOT) for p in proto_files()}:
        # Make every generated folder a regular package (pagedserve/ itself already is one).
        for parent in [package_dir, *package_dir.parents][:-2]:
            init = out_dir / parent / "__init__.py"
            if not init.exists():
                init.write_text('"""Generated from protos/ by scripts/gen_protos.py; do not edit."""\n')


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repository)")
    args = parser.parse_args()
    generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
