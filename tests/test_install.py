"""The Jetson install resolves (issue #22): pip keeps NVIDIA's pre-release torch and picks the
CUDA 12 Python stack with NumPy 1.x. pip's resolver and ``packaging`` are the oracles; the
resolution tests need PyPI (CI has it) and take a few seconds each."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python >= 3.11's tomllib")

ROOT = Path(__file__).resolve().parents[1]
JETPACK6_CONSTRAINTS = ROOT / "constraints-jetpack6.txt"
# NVIDIA's JetPack 6 builds: 6.0 (the one `torch>=2.3` rejects) and 6.1/6.2.
NVIDIA_TORCH = ["2.3.0a0+40ec155e58.nv24.03", "2.5.0a0+872d972e41.nv24.08"]
STUB_TORCH = "2.3.0a0+40ec155e58.nv24.03"


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirement(name: str, reqs: list[str]) -> Requirement:
    found = [r for r in map(Requirement, reqs) if canonicalize_name(r.name) == name]
    assert len(found) == 1, f"{name} in {reqs}"
    return found[0]


def test_torch_requirement_accepts_nvidia_prereleases() -> None:
    spec = requirement("torch", project()["dependencies"]).specifier
    for v in NVIDIA_TORCH + ["2.13.0+cpu", "2.3.0"]:
        assert spec.contains(v), f"{spec} rejects torch {v}"
    assert not spec.contains("2.2.2")
    # The trap the requirement avoids: a plain lower bound excludes JetPack 6.0's build.
    assert not Requirement("torch>=2.3").specifier.contains(NVIDIA_TORCH[0], prereleases=True)


def test_jetson_extra_is_cuda12_with_numpy1() -> None:
    extra = project()["optional-dependencies"]["jetson"]
    assert not requirement("cuda-bindings", extra).specifier.contains("13.0.0")
    assert requirement("cuda-bindings", extra).specifier.contains("12.9.10")
    assert not requirement("numpy", extra).specifier.contains("2.0.0")
    requirement("cuda-core", extra)
    requirement("jetson-stats", extra)


def pip(*args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "--python", python, "--disable-pip-version-check", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def installs(report: Path) -> dict[str, Version]:
    return {
        canonicalize_name(i["metadata"]["name"]): Version(i["metadata"]["version"])
        for i in json.loads(report.read_text())["install"]
    }


def source_copy(dst: Path) -> Path:
    """What pip needs to read the project's metadata, outside the work tree (pip would
    otherwise write an egg-info into it)."""
    dst.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dst / name)
    (dst / "edge").mkdir()
    (dst / "edge" / "__init__.py").write_text("")
    return dst


def test_jetson_install_keeps_nvidia_torch(tmp_path: Path) -> None:
    """README's Jetson command, resolved in a fresh venv that holds a stub of NVIDIA's torch."""
    stub = tmp_path / "stub"
    (stub / "torch").mkdir(parents=True)
    (stub / "torch" / "__init__.py").write_text(f"__version__ = {STUB_TORCH!r}\n")
    (stub / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        f'[project]\nname = "torch"\nversion = "{STUB_TORCH}"\n[tool.setuptools]\npackages = ["torch"]\n'
    )
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = str(venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python"))
    pip("wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(stub))
    (wheel,) = (tmp_path / "dist").glob("torch-*.whl")
    pip("install", "--no-deps", "-q", str(wheel), python=python)

    report = tmp_path / "report.json"
    src = source_copy(tmp_path / "src")
    pip("install", "--dry-run", "-q", "--report", str(report), "-c", str(JETPACK6_CONSTRAINTS),
        f"{src}[jetson,server]", python=python)
    chosen = installs(report)
    assert "torch" not in chosen, f"pip replaces NVIDIA's torch with {chosen.get('torch')}"
    assert chosen["cuda-bindings"].major == 12, chosen["cuda-bindings"]
    assert "cuda-core" in chosen and "jetson-stats" in chosen
    assert chosen["numpy"] < Version("2"), chosen["numpy"]


def test_jetson_stack_has_jetpack6_wheels(tmp_path: Path) -> None:
    """The same requirements for the board itself (aarch64, CPython 3.10), binary wheels only,
    with the NVRTC wheel that JetPack 6.1/6.2 may use instead of the toolkit's."""
    proj = project()
    reqs = [r for r in proj["dependencies"] if canonicalize_name(Requirement(r).name) != "torch"]
    reqs += proj["optional-dependencies"]["jetson"] + ["nvidia-cuda-nvrtc-cu12"]
    report = tmp_path / "report.json"
    pip("install", "--dry-run", "-q", "--ignore-installed", "--report", str(report), "--only-binary=:all:",
        "--platform", "manylinux2014_aarch64", "--platform", "manylinux_2_28_aarch64", "--python-version", "3.10",
        "--implementation", "cp", "--target", str(tmp_path / "target"), "-c", str(JETPACK6_CONSTRAINTS), *reqs)
    chosen = installs(report)
    assert chosen["cuda-bindings"].major == 12 and chosen["numpy"] < Version("2")
    assert chosen["nvidia-cuda-nvrtc-cu12"].release[:2] == (12, 6)
    assert "cuda-core" in chosen and "torch" not in chosen
    urls = [i["download_info"]["url"] for i in json.loads(report.read_text())["install"]]
    assert all("aarch64" in u or "-none-any" in u for u in urls), urls


def fake_wheel(index: Path, version: str) -> None:
    """A metadata-only torch wheel of ``version`` in a PEP 503 index directory."""
    import zipfile

    project = index / "torch"
    project.mkdir(parents=True, exist_ok=True)
    name = f"torch-{version}-py3-none-any.whl"
    dist = f"torch-{version}.dist-info"
    with zipfile.ZipFile(project / name, "w") as z:
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    (project / "index.html").write_text(f'<html><body><a href="{name}">{name}</a></body></html>')
    (index / "index.html").write_text('<html><body><a href="torch/">torch</a></body></html>')


def test_cpu_index_gives_the_cpu_build_under_the_pin(tmp_path: Path) -> None:
    """The README's CPU install: PyPI serves torch 2.13.0 (on x86-64 Linux, the CUDA build),
    PyTorch's CPU index 2.13.0+cpu. Under constraints.txt's pin pip takes the +cpu build
    when the CPU index is an extra index, and PyPI's without it. pip's resolver is the
    oracle; two local indexes stand in for PyPI and the CPU index."""
    pin = next(ln for ln in (ROOT / "constraints.txt").read_text().splitlines() if ln.startswith("torch=="))
    version = pin.removeprefix("torch==")
    pypi, cpu = tmp_path / "pypi", tmp_path / "cpu"
    fake_wheel(pypi, version)
    fake_wheel(cpu, f"{version}+cpu")

    def chosen(*index_args: str) -> str:
        report = tmp_path / "report.json"
        cmd = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", "install", "--dry-run",
               "-q", "--ignore-installed", "--no-deps", "--report", str(report), "-c", str(ROOT / "constraints.txt"),
               "--index-url", pypi.as_uri(), *index_args, "torch"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stdout + r.stderr
        return str(installs(report)["torch"])

    assert chosen("--extra-index-url", cpu.as_uri()) == f"{version}+cpu"
    assert chosen() == version
