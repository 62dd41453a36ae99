"""Builds the CPU kernels (backends/cpu/*.c) through cffi's setuptools integration; all other
metadata is in pyproject.toml. `pip install -e .` rebuilds them."""
from setuptools import setup

setup(cffi_modules=["backends/cpu/build.py:ffibuilder"])
