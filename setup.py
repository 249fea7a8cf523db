"""The package's one C extension, gpusparse._jsonl_native (the JSONL reader's native pass).

Everything else is declared in pyproject.toml. The extension uses CPython's limited API
(3.11): one ``.abi3.so`` serves every CPython from 3.11 on. Building from source needs a C
compiler and CPython's headers; without the built module the reader warns and reads by its
numpy path (see gpusparse.jsonl_native).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gpusparse._jsonl_native",
            sources=["src/gpusparse/_jsonl_native.c"],
            define_macros=[("Py_LIMITED_API", "0x030B0000")],
            py_limited_api=True,
            extra_compile_args=["-O3", "-std=c11"],
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
