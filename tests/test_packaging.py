"""The built wheel is the package users install: every module, the page, nothing else at
the top, and it runs from the repository root, where the checkout's `corral/` comes
first on the path (the shadowing that once broke the README's install)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    src = out / "src"  # a clean copy: a stale build/ would hide missing packages
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "corral", src / "corral", ignore=shutil.ignore_patterns("__pycache__"))
    # No build isolation: the dev venv's setuptools builds it, so no index is needed.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "--quiet", "-w", str(out), str(src)], check=True, timeout=300)
    [built] = list(out.glob("corral-*.whl"))
    return built


def test_wheel_contains_every_module(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {p.relative_to(ROOT).as_posix() for p in (ROOT / "corral").rglob("*.py")}
    assert expected <= names, sorted(expected - names)
    page = {f"corral/server/ui/{p.name}" for p in (ROOT / "corral/server/ui").iterdir()}
    assert page and page <= names, sorted(page - names)  # the page at /ui ships in the wheel
    top = {n.split("/")[0] for n in names if "/" in n and ".dist-info/" not in n}
    assert top == {"corral"}, top  # no bare `api`, `server`, `runner`... in site-packages


def test_installed_wheel_runs_from_the_repository_root(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    with zipfile.ZipFile(wheel) as whl:  # a wheel is a zip laid out as site-packages
        whl.extractall(site)
    # The dependencies come from this venv, after the fresh one's own site-packages; its
    # .pth files (the editable install's finder among them) are not read from there.
    (site / "zz_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # From the root the checkout's corral/ comes first on the path; from elsewhere the
    # wheel's own copy runs. Both must be the whole package.
    for cwd in (ROOT, tmp_path):
        for module in ("corral.server", "corral.cli"):
            ran = subprocess.run([str(python), "-m", module, "--help"], cwd=cwd, env=env,
                                 capture_output=True, text=True, timeout=120)
            assert ran.returncode == 0, ran.stdout + ran.stderr
            assert "usage" in ran.stdout.lower(), ran.stdout
    where = subprocess.run([str(python), "-c", "import corral.registry.starter as s; print(s.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert where.stdout.startswith(str(site)), where.stdout
