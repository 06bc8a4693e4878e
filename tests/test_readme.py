"""README.md and docs/: the test command is the one CI runs, the README stays short, every
link resolves inside the repository, and the docs speak of the product (no work log)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def code_lines(text: str) -> list[str]:
    return [ln.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S) for ln in block.splitlines()]


def test_readme_test_command_is_ci() -> None:
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.startswith("pip ")]
    assert len(ci) == 1
    assert ci[0] in code_lines(README.read_text())
    assert "python -m pytest" in ci[0] and "constraints.txt" in ci[0]


def test_readme_install_takes_the_cpu_wheel_index() -> None:
    text = README.read_text()
    install = next(ln for ln in code_lines(text) if ln.startswith("pip install") and "edge generate" in ln)
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in install and "-c constraints.txt" in install
    assert "random weights" in text  # the embedded model is not mistaken for a broken install


def test_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) <= 250


def slug(title: str) -> str:
    """GitHub's anchor for a heading."""
    title = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return title.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"(?m)^#+ (.*)$", text)}


def test_links_resolve_inside_the_repository() -> None:
    for doc in [README, *DOCS]:
        for target in LINK.findall(doc.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            assert path.is_relative_to(ROOT) and path.exists(), f"{doc.name}: {target}"
            if anchor and path.suffix == ".md":
                assert anchor in anchors(path), f"{doc.name}: {target} (no such heading)"


def test_docs_point_at_nothing_outside_the_repository() -> None:
    for doc in [README, *DOCS]:
        text = doc.read_text()
        for bad in ("/work/", "shared/DESIGN", "DESIGN.md", "../"):
            assert bad not in text, f"{doc.name} refers to {bad!r}"


def test_docs_speak_of_the_product() -> None:
    worklog = re.compile(r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|this|last|next) "
                         r"session\b|\bissue #?\d+|\(#\d+\)|\bthis round\b", re.I)
    for doc in [README, *DOCS]:
        found = worklog.findall(doc.read_text())
        assert not found, f"{doc.name}: {found}"
