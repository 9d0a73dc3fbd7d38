"""Build of the ``modelops_native._engine`` extension (C++17, pybind11, no other native deps)."""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "modelops_native._engine",
            ["src/constraints.cpp", "src/kernels.cpp", "src/bindings.cpp"],
            include_dirs=["src"],
            cxx_std=17,
            # -O3 vectorizes the mask/apply loops; no -march=native: the image may run on another CPU.
            extra_compile_args=["-O3", "-fvisibility=hidden"],
            depends=["src/constraints.hpp", "src/kernels.hpp", "src/thread_pool.hpp"],
        )
    ],
    cmdclass={"build_ext": build_ext},
)
