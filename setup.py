"""The checkpoint kernels are a small C extension; everything else is in pyproject.toml.

The extension is optional: without a C compiler rayzip installs and falls back to numpy
and zstd (slower, same format).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("rayzip.checkpoint._kernels", ["rayzip/checkpoint/_kernels.c"],
                             extra_compile_args=["-O3", "-std=c99"], optional=True)])
