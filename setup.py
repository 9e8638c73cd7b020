"""The C kernel of `msprobe_engine/cpu_kernel/`, built at install time.

`cpu_reduce.c` uses no Python API: it is built as a plain shared library that `cpu_kernel/library.py`
loads from the package (torch calls it with ctypes, MindSpore as custom operators) (no compiler is needed where the wheel is installed). The
rest of the project's metadata is in pyproject.toml.
"""
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

#: no -ffast-math: it would drop the nan and signed-zero semantics (the same as cpu_kernel.library.FLAGS)
FLAGS = ["-O3", "-std=gnu11"]


class PlainLibrary(build_ext):
    """Builds the kernel as a plain C shared library: no Python module init symbol to export."""

    def get_export_symbols(self, ext: Extension) -> list:
        return []


setup(
    ext_modules=[Extension("msprobe_engine.cpu_kernel._cpu_reduce",
                           sources=["msprobe_engine/cpu_kernel/cpu_reduce.c"],
                           extra_compile_args=FLAGS, optional=True)],
    cmdclass={"build_ext": PlainLibrary},
)
