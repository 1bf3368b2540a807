"""Build hook: the demo's config, ``configs/demo.toml``, ships inside the package as ``albatross/configs/demo.toml``,
so that ``albatross demo`` of an installed wheel finds it. The repository keeps the one file; nothing to keep in
step. Everything else about the build is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PACKAGED_CONFIGS = ("demo.toml",)


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "albatross" / "configs"
        target.mkdir(parents=True, exist_ok=True)
        for name in PACKAGED_CONFIGS:
            shutil.copy2(Path(__file__).resolve().parent / "configs" / name, target / name)


setup(cmdclass={"build_py": BuildPy})
