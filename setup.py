"""The package's C extensions: gpusparse._jsonl_native (the JSONL reader's native pass) and
gpusparse._queries_native (a query batch's quantization and padded layout).

Everything else is declared in pyproject.toml. The extensions use CPython's limited API
(3.11): one ``.abi3.so`` serves every CPython from 3.11 on. Building from source needs a C
compiler and CPython's headers; without a built module its caller warns and takes its numpy
path (see gpusparse.jsonl_native, gpusparse.queries_native).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            f"gpusparse.{name}",
            sources=[f"src/gpusparse/{name}.c"],
            depends=["src/gpusparse/_native_buffers.h"],
            define_macros=[("Py_LIMITED_API", "0x030B0000")],
            py_limited_api=True,
            extra_compile_args=["-O3", "-std=c11"],
        )
        for name in ("_jsonl_native", "_queries_native")
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
