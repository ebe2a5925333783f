"""Build the small C core (beluga._native._core); everything else is pure Python."""

import glob

from setuptools import Extension, setup

# Instructions beyond the baseline ISA are enabled per function with target
# attributes and chosen at run time from CPUID, so one build runs everywhere.
extra_compile_args = ["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"]

setup(
    ext_modules=[
        Extension(
            "beluga._native._core",
            sources=sorted(glob.glob("beluga/_native/*.c")),
            depends=glob.glob("beluga/_native/*.h"),
            extra_compile_args=extra_compile_args,
        )
    ]
)
