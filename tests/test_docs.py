"""The documentation's references hold: every relative link in the README and docs/ reaches a file of the
repository, and every `docs/...` path that code, tests or docs mention exists (benchmark and evaluation results
live under docs/results/; a move that forgets a reference fails here)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
DOCS_PATH = re.compile(r"(?<![\w/.-])docs/[\w./-]+\.(?:md|json|png)\b")
# Other projects' documents, cited by their path in those projects (Triton's docs/protocol, KServe's predict-api)
OTHER_PROJECTS = ("docs/protocol/", "docs/predict-api/")


def tracked(*patterns: str) -> list[Path]:
    """The repository's files as the working tree has them: tracked and new ones (not ignored), less those deleted, so
    a move is checked before it is committed."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", *patterns],
                            cwd=REPO, capture_output=True, check=True).stdout
    return [REPO / name for name in dict.fromkeys(listed.decode().split("\0")) if name and (REPO / name).is_file()]


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *[p for p in tracked("docs") if p.suffix == ".md"]]


def test_every_relative_link_in_the_docs_reaches_a_file():
    broken = []
    for page in markdown_files():
        for target in LINK.findall(page.read_text()):
            path = target.split("#", 1)[0]
            if not path or re.match(r"[a-z]+:", path):  # an anchor on the page, or a URL
                continue
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, "\n".join(broken)


def test_every_docs_path_mentioned_anywhere_exists():
    missing = set()
    for file in tracked():
        if file.suffix not in (".py", ".md", ".sh", ".yml", ".yaml", ".toml", ".cfg", ".txt", "") or not file.is_file():
            continue
        try:
            text = file.read_text()
        except UnicodeDecodeError:
            continue
        for mention in DOCS_PATH.findall(text):
            mention = mention.rstrip(".")
            if mention.startswith(OTHER_PROJECTS):
                continue
            if not (REPO / mention).exists():
                missing.add(f"{file.relative_to(REPO)}: {mention}")
    assert not missing, "\n".join(sorted(missing))


def test_results_live_in_one_folder():
    loose = [p.name for p in (REPO / "docs").iterdir() if p.name.startswith("bench")]
    assert not loose, f"benchmark results belong under docs/results/: {loose}"
