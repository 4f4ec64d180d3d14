"""Regenerate the Python code for gradsync.proto: `python -m gradsync.proto.generate`.

protoc runs with the repository root on its include path, so the generated
modules import each other as `gradsync.proto.gradsync_pb2`.
"""

from __future__ import annotations

import os
import sys

PROTO = os.path.join("gradsync", "proto", "gradsync.proto")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def generate(out_dir: str = ROOT) -> None:
    """Write gradsync_pb2.py, gradsync_pb2.pyi and gradsync_pb2_grpc.py under out_dir/gradsync/proto.

    Raises:
        RuntimeError: protoc failed (the message has its exit code).
    """
    from grpc_tools import protoc

    os.makedirs(os.path.join(out_dir, "gradsync", "proto"), exist_ok=True)
    code = protoc.main(
        [
            "protoc",
            f"-I{ROOT}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            os.path.join(ROOT, PROTO),
        ]
    )
    if code != 0:
        raise RuntimeError(f"protoc exited with {code} on {PROTO}: fix the .proto and run again")


if __name__ == "__main__":
    generate(sys.argv[1] if len(sys.argv) > 1 else ROOT)
