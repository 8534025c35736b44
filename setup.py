"""Build: every package under each folder that setup.cfg maps into `gepool`, found, never listed by hand."""

import configparser
import os

from setuptools import find_packages, setup

_cfg = configparser.ConfigParser()
_cfg.read(os.path.join(os.path.dirname(os.path.abspath(__file__)), "setup.cfg"))
ROOTS = dict(line.replace(" ", "").split("=", 1)
             for line in _cfg.get("options", "package_dir").splitlines() if "=" in line)


def packages() -> list[str]:
    found = []
    for name, folder in ROOTS.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_packages(folder)]
    return found


setup(package_dir=ROOTS, packages=packages())
