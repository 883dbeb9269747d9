"""Package layout (metadata lives in pyproject.toml).

The top-level folders ``server/`` and ``pallas_kernels/`` (the design card's layout) install under the
``jaxmoe`` namespace as ``jaxmoe.server`` and ``jaxmoe.pallas_kernels``, so no generic top-level name
(``server``) lands in site-packages.
"""

from setuptools import find_packages, setup

NESTED = {"jaxmoe.server": "server", "jaxmoe.pallas_kernels": "pallas_kernels"}

packages = find_packages(include=["jaxmoe", "jaxmoe.*"])
for name, folder in NESTED.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=NESTED)
