"""Thin shim for users who expect `python setup.py develop` / `pip install -e .`; metadata is in pyproject.toml."""
from setuptools import setup

setup()
