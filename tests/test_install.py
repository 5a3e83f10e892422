"""The wheel installs the way an engine's user installs it: into an environment that already has torch.

An engine (vLLM, an HF server) brings its own torch build (CPU, or CUDA for its driver); installing
kvstore next to it must never replace it. Here: the wheel is built from a copy of the repository,
a fresh virtual environment is made from the same base interpreter, and this environment's
site-packages (torch, transformers, every dependency) is made visible in it through a ``.pth``
file, standing in for the engine's packages. ``pip install --no-index kvstore-tiered[hf]`` must
then succeed with no download (every dependency already there) and leave that torch alone.

This environment has kvstore installed editable (its ``__editable__`` finder and dist-info point
at the checkout): the fresh environment sees a folder of links to everything here except those,
so its ``import kvstore`` can only find the installed wheel. About 15 s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

import pytest
import torch

import kvstore

# One worker builds and installs once for every test here (tests/conftest.py keeps this file's tests together)

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTION = "kvstore-tiered"
# What the fresh environment must not see from this one: kvstore's own editable install.
OWN_FILES = ("__editable__", "kvstore_tiered")
SOURCE_IGNORED = shutil.ignore_patterns(
    ".*", "__pycache__", "*.egg-info", "build", "dist", "site", "*.pyc"
)  # .git, .venv, .venv-vllm, caches: a wheel needs none of them


def offline_env() -> dict[str, str]:
    """This process's environment with no pip configuration (no index, no find-links, no constraints)
    and nothing that points Python at this environment."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("PIP_") and key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    }
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


def run(argv: list[str | Path], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(arg) for arg in argv], cwd=cwd, env=offline_env(), capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{argv} failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


@dataclass
class Installed:
    wheel: Path
    venv: Path
    site: Path  # the fresh environment's own site-packages
    engine_site: Path  # the folder of links standing in for the engine's packages
    install_log: str

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def python_json(self, code: str, cwd: Path) -> dict:
        return json.loads(run([self.python, "-c", code], cwd=cwd).stdout.strip().splitlines()[-1])


def build_wheel(work: Path) -> Path:
    """An in-tree build writes build/ and egg-info: build from a copy, so the checkout stays as it is."""
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=SOURCE_IGNORED)
    out = work / "wheels"
    # No build isolation: setuptools comes from this environment (offline); it builds wheels itself
    # (bdist_wheel is part of setuptools since 70.1), so the `wheel` package is not needed.
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", source, "-w", out],
        work,
    )
    (wheel,) = out.glob("*.whl")
    return wheel


def engine_packages(work: Path) -> Path:
    """A folder of links to every entry of this environment's site-packages but kvstore's own."""
    ours = Path(sysconfig.get_paths()["purelib"])
    assert Path(torch.__file__).resolve().is_relative_to(ours.resolve()), "torch is expected in this venv"
    folder = work / "engine-site-packages"
    folder.mkdir()
    for entry in ours.iterdir():
        if entry.name.startswith(OWN_FILES) or entry.name in ("kvstore", "__pycache__") or entry.suffix == ".pth":
            continue  # .pth files are not read from a folder a .pth file adds; left out to say so
        (folder / entry.name).symlink_to(entry)
    return folder


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    work = tmp_path_factory.mktemp("install")
    wheel = build_wheel(work)
    venv = work / "venv"
    base = getattr(sys, "_base_executable", sys.executable)  # the interpreter this venv was made from
    # No pip of its own: ensurepip's pip comes with setuptools 65, which would shadow the engine's
    # (torch needs setuptools >= 77). pip is among the engine's packages; run from the fresh
    # interpreter, it installs into the fresh environment.
    run([base, "-m", "venv", "--without-pip", venv], work)
    python = venv / "bin" / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], work).stdout.strip())
    engine_site = engine_packages(work)
    (site / "engine-packages.pth").write_text(f"{engine_site}\n")

    # The engine's torch is installed, as far as the fresh environment's pip can tell.
    listed = {
        p["name"].lower(): p["version"]
        for p in json.loads(run([python, "-m", "pip", "list", "--format=json"], work).stdout)
    }
    assert listed.get("torch") == torch.__version__, listed
    assert DISTRIBUTION not in listed, f"kvstore leaks from the outer environment: {listed[DISTRIBUTION]}"

    done = run([python, "-m", "pip", "install", "--no-index", f"{wheel}[hf]"], work, timeout=300)
    return Installed(wheel, venv, site, engine_site, done.stdout + done.stderr)


def test_install_keeps_the_engines_torch(installed: Installed, tmp_path: Path):
    found = installed.python_json(
        "import json, torch; print(json.dumps({'file': torch.__file__, 'version': torch.__version__}))", tmp_path
    )
    assert found["version"] == torch.__version__
    assert os.path.realpath(found["file"]) == os.path.realpath(torch.__file__)
    assert Path(found["file"]).is_relative_to(installed.engine_site), found  # not a copy in the fresh venv
    assert not (installed.site / "torch").exists()
    success = [line for line in installed.install_log.splitlines() if line.startswith("Successfully installed")]
    assert success == [f"Successfully installed {DISTRIBUTION}-{kvstore.__version__}"], installed.install_log


def test_import_finds_the_installed_wheel_not_the_checkout(installed: Installed, tmp_path: Path):
    found = installed.python_json(
        "import json, kvstore; print(json.dumps({'file': kvstore.__file__, 'version': kvstore.__version__}))", tmp_path
    )
    assert Path(found["file"]).resolve().is_relative_to(installed.site.resolve()), found
    assert not Path(found["file"]).resolve().is_relative_to(ROOT), found
    assert found["version"] == kvstore.__version__ == "0.1.0"
    # what needs the hf extra imports too (transformers from the engine's packages)
    installed.python_json("import json, kvstore.connectors.hf; print(json.dumps({}))", tmp_path)


def test_pip_show_names_the_distribution(installed: Installed, tmp_path: Path):
    shown = run([installed.python, "-m", "pip", "show", DISTRIBUTION], tmp_path).stdout
    fields = dict(line.split(": ", 1) for line in shown.splitlines() if ": " in line)
    assert fields["Name"] == DISTRIBUTION
    assert fields["Version"] == "0.1.0"
    assert Path(fields["Location"]).resolve() == installed.site.resolve()


def test_console_script_prints_the_version(installed: Installed, tmp_path: Path):
    script = installed.venv / "bin" / "kvstore"
    assert script.is_file()
    for argv in (["--version"], ["version"]):  # the option and the older subcommand
        done = run([script, *argv], tmp_path)
        assert done.stdout.strip().endswith("0.1.0"), (argv, done.stdout)


def test_wheel_contents(installed: Installed):
    assert installed.wheel.name.startswith("kvstore_tiered-0.1.0-"), installed.wheel.name
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = set(wheel.namelist())
        assert "kvstore/py.typed" in names
        dist_info = "kvstore_tiered-0.1.0.dist-info"
        metadata = Parser().parsestr(wheel.read(f"{dist_info}/METADATA").decode())
        licenses = [name for name in names if name.startswith(f"{dist_info}/") and "LICENSE" in name.rsplit("/", 1)[-1]]
        assert licenses, sorted(n for n in names if n.startswith(dist_info))
        license_text = wheel.read(licenses[0]).decode()
    assert metadata["Name"] == DISTRIBUTION
    assert "Apache-2.0" in (metadata.get("License-Expression"), metadata.get("License")), dict(metadata)
    assert "LICENSE" in metadata.get_all("License-File", [])
    assert license_text == (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert not any(name.startswith(("tests/", "examples/", "scripts/")) for name in names)
    # the research benchmarks run from a clone; the wheel keeps what `kvstore bench` runs
    assert not any(name.startswith(("benchmarks/", "kvstore/devtools/")) for name in names)
    assert {"kvstore/bench/local.py", "kvstore/testing/servers.py", "kvstore/cli/demo.py"} <= names
