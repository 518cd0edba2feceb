"""Write typecheck/kvpipe/: a symlink per package, the installed layout for tools that read files.

pyproject.toml's ``[tool.setuptools] package-dir`` installs the top-level folders as
``kvpipe.pipeline``, ``kvpipe.stages`` and ``kvpipe.connector``. An installed wheel
has that layout on disk; an editable install (``make install``) gets it from
setuptools' editable finder, an import hook that only a running interpreter follows.
Static tools (mypy, pyright and basedpyright, an editor's language server) and the
bare ``python3`` of ``make gpu-check`` see folders instead, so this script gives them
the layout: ``typecheck/kvpipe/<name> -> ../../<folder>`` for each ``kvpipe.<name>``
that package-dir maps (relative links: the checkout may move or be copied). With
``typecheck/`` on their search path (mypy's ``mypy_path``, pyright's ``extraPaths``,
``PYTHONPATH``), ``import kvpipe.stages`` is ``stages/``. ``kvpipe`` itself stays a
namespace package, as installed: no ``__init__.py``.

The links are generated, never edited (and not committed): ``make typecheck`` runs
this, and so do ``make lint`` and ``make gpu-site``. A link package-dir no longer maps
is removed. ``--check`` changes nothing and exits 1 when the links are not what
package-dir says. Standard library only (``tomllib``: Python 3.11+), so any python3
of that age runs it, the GPU machine's too.
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "typecheck"


def wanted_links(pyproject: Path = ROOT / "pyproject.toml") -> dict[Path, str]:
    """Each link to write (its path) and its target, relative to the link's folder."""
    package_dir: dict[str, str] = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-dir"]
    links: dict[Path, str] = {}
    for package, folder in package_dir.items():
        if not package:  # "" (the root's packages) maps no name to a folder
            continue
        link = TREE.joinpath(*package.split("."))
        links[link] = os.path.relpath(ROOT / folder, link.parent)
    return links


def stale_links(links: dict[Path, str]) -> list[Path]:
    """Links under the generated folders that package-dir no longer maps."""
    folders = {link.parent for link in links}
    return sorted(
        entry
        for folder in folders
        if folder.is_dir()
        for entry in folder.iterdir()
        if entry.is_symlink() and entry not in links
    )


def differences(links: dict[Path, str]) -> list[str]:
    wrong = [
        f"{link.relative_to(ROOT)} -> {target}"
        for link, target in links.items()
        if not link.is_symlink() or os.readlink(link) != target
    ]
    return wrong + [f"{link.relative_to(ROOT)} (stale)" for link in stale_links(links)]


def write(links: dict[Path, str]) -> None:
    for link, target in links.items():
        if link.is_symlink() and os.readlink(link) == target:
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.exists() and not link.is_symlink():
            raise SystemExit(f"{link.relative_to(ROOT)} is a real file or folder, not a link: remove it")
        partial = link.with_name(f".{link.name}.{os.getpid()}")
        partial.symlink_to(target, target_is_directory=True)
        partial.replace(link)  # atomic: a tool running meanwhile sees the old link or the new
    for link in stale_links(links):
        link.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a link is not right")
    args = parser.parse_args(argv)
    links = wanted_links()
    if args.check:
        wrong = differences(links)
        for line in wrong:
            print(f"typecheck links: {line}: run make typecheck", file=sys.stderr)
        return 1 if wrong else 0
    write(links)
    return 0


if __name__ == "__main__":
    sys.exit(main())
