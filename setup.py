from setuptools import find_packages, setup

# fibctl.migrations lives in the top-level migrations/ folder (package-dir in pyproject.toml).
setup(packages=find_packages(include=["fibctl", "fibctl.*"])
      + ["fibctl.migrations"] + [f"fibctl.{p}" for p in find_packages(include=["migrations.*"])])
