"""The wheel carries the daemon's jar: built here when javac is on the machine.

Everything else is in pyproject.toml. ``build_py`` copies the Java sources
into the wheel (``daemon/spark/jvm``) and, when ``javac`` and pyspark are at
hand (a build with ``--no-build-isolation`` in the project's venv), compiles
the jar into it; otherwise the wheel has the sources only and
``eventplane setup`` builds the jar after the install (daemon/spark/jarbuild.py).
An editable install skips both: ``make`` builds the jar in the checkout.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).parent


def _jarbuild():  # type: ignore[no-untyped-def]
    """daemon/spark/jarbuild.py, loaded by path: the package is not importable yet."""
    spec = importlib.util.spec_from_file_location("_jarbuild", HERE / "daemon/spark/jarbuild.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithJar(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        spark = Path(self.build_lib) / "daemon" / "spark"
        shutil.copytree(HERE / "jvm" / "src", spark / "jvm", dirs_exist_ok=True)
        jarbuild = _jarbuild()
        if importlib.util.find_spec("pyspark") is None:
            print("note: pyspark is not in the build environment: the wheel has no jar")
            return
        try:
            took = jarbuild.build(spark / "jars" / "eventplane-hadoop.jar", spark / "jvm")
        except jarbuild.JarBuildError as exc:
            print(f"note: {exc}: the wheel has no jar (`eventplane setup` builds it)")
            return
        print(f"built the daemon's jar into the wheel in {took:.1f} s")


setup(cmdclass={"build_py": BuildPyWithJar})
