"""Package list for setuptools (everything else is in pyproject.toml).

The services live under services/<name>/ (the design card's layout) but install as
refitplane.<name>; setuptools' declarative `packages.find` cannot discover packages that
a `package-dir` entry maps from another folder, so they are listed here.
"""

from setuptools import find_packages, setup

SERVICES = ("coordinator", "trainer", "generator")

packages = find_packages(include=["refitplane", "refitplane.*"])
package_dir = {"refitplane": "refitplane"}
for service in SERVICES:
    root = f"refitplane.{service}"
    package_dir[root] = f"services/{service}"
    packages += [root, *(f"{root}.{sub}" for sub in find_packages(f"services/{service}"))]

setup(packages=packages, package_dir=package_dir)
