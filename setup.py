"""Build hook: generate the Python gRPC stubs from proto/ with grpcio-tools."""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "proto"
OUT = ROOT / "src"


def generate_stubs() -> None:
    from grpc_tools import protoc
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    for proto in sorted(PROTO_ROOT.rglob("*.proto")):
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={OUT}",
                f"--pyi_out={OUT}", f"--grpc_python_out={OUT}", str(proto)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")


class BuildPyWithStubs(build_py):
    def run(self):
        generate_stubs()
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
