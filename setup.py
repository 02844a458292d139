"""Package discovery that pyproject.toml cannot say on its own (everything else is in pyproject.toml).

nodectl's packages are found, not listed, so a new one is in the wheel without anyone remembering to add it.
launchers/, templates/ and trainer/ sit at the top of the repository (the design's layout) and install inside
nodectl.resources: a wheel carries them, and no generic top-level name (`trainer`) is claimed in site-packages.
"""
from setuptools import find_packages, setup

RESOURCES = ("launchers", "templates", "trainer")


def packages_and_dirs() -> tuple[list[str], dict[str, str]]:
    packages = find_packages(include=["nodectl", "nodectl.*"])
    dirs = {}
    for folder in RESOURCES:
        name = f"nodectl.resources.{folder}"
        dirs[name] = folder
        packages += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]
    return packages, dirs


packages, package_dir = packages_and_dirs()
setup(packages=packages, package_dir=package_dir)
