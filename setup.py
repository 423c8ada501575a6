"""Only the C extensions live here; everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            f"tensorbroker.{package}.{name}",
            sources=[f"{package}/{name}.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
        )
        for package, name in (("client", "_dlpack"), ("common", "_shm"))
    ]
)
