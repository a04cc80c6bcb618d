"""The checkpoint kernels and the codecs' fused encoders are small C extensions; everything
else is in pyproject.toml.

Both are optional: without a C compiler rayzip installs and falls back to numpy, torch and
zstd (slower, same formats).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("rayzip.checkpoint._kernels", ["rayzip/checkpoint/_kernels.c"],
                             extra_compile_args=["-O3", "-std=c99"], optional=True),
                   # -fno-math-errno: sqrtf then vectorizes (nothing reads errno; results are the same)
                   Extension("rayzip.codecs._kernels", ["rayzip/codecs/_kernels.c"],
                             extra_compile_args=["-O3", "-std=c99", "-fno-math-errno"], optional=True)])
