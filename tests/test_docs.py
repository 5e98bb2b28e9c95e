"""The documentation's references hold: every relative link in the README and docs/ reaches a file of the
repository, and every `docs/...` path that code, tests or docs mention exists (benchmark and evaluation results
live under docs/results/; a move that forgets a reference fails here). A path cited `at commit REV` must exist at
that commit instead: a page git keeps but the tree no longer does. docs/results/ holds to its pages' rules
(bench/pages.py): every page reached from docs/README.md, its JSON beside it, no machine path, no run from an
uncommitted tree."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
DOCS_PATH = re.compile(r"(?<![\w/.-])docs/[\w./-]+\.(?:md|json|png)\b")
# Other projects' documents, cited by their path in those projects (Triton's docs/protocol, KServe's predict-api)
OTHER_PROJECTS = ("docs/protocol/", "docs/predict-api/")
# a page cited where git keeps it: its path, then "at commit REV" (code spans allowed)
AT_COMMIT = re.compile(r"`? at commit `?([0-9a-f]{7,40})\b")
# A run's own command in a results page says where that run wrote its report, since filed as a section of its page
RUN_OUT = "--out "


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


def git_ok(*args: str) -> bool:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True).returncode == 0


# A shallow clone lacks the commits a page cites for an earlier run: there those citations cannot be checked
SHALLOW = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True,
                         text=True).stdout.strip() == "true"


def exists_at(commit: str, path: str) -> bool:
    if SHALLOW and not git_ok("cat-file", "-e", f"{commit}^{{commit}}"):
        return True
    return git_ok("cat-file", "-e", f"{commit}:{path}")


def test_every_docs_path_mentioned_anywhere_exists():
    missing = set()
    for file in tracked():
        if file.suffix not in (".py", ".md", ".sh", ".yml", ".yaml", ".toml", ".cfg", ".txt", "") or not file.is_file():
            continue
        try:
            text = file.read_text()
        except UnicodeDecodeError:
            continue
        in_results = file.parent == REPO / "docs" / "results"
        for found in DOCS_PATH.finditer(text):
            mention = found[0].rstrip(".")
            if mention.startswith(OTHER_PROJECTS):
                continue
            if in_results and text[:found.start()].endswith(RUN_OUT):
                continue
            if at := AT_COMMIT.match(text, found.end()):
                if not exists_at(at[1], mention):
                    missing.add(f"{file.relative_to(REPO)}: {mention} is not at {at[1]}")
            elif not (REPO / mention).exists():
                missing.add(f"{file.relative_to(REPO)}: {mention}")
    assert not missing, "\n".join(sorted(missing))


@pytest.mark.skipif(SHALLOW, reason="a shallow clone lacks the commit cited")
def test_a_path_at_a_commit_is_checked_there():
    cited = "its run, `docs/results/bench-peers-cpu.md` at commit `3da9a7c`, is not repeated"
    found = DOCS_PATH.search(cited)
    at = AT_COMMIT.match(cited, found.end())
    assert at[1] == "3da9a7c" and exists_at(at[1], found[0])
    assert not exists_at(at[1], "docs/" + "no-such-page.md")


def test_results_live_in_one_folder():
    loose = [p.name for p in (REPO / "docs").iterdir() if re.match(r"bench[-.]", p.name)]  # a report, not a guide
    assert not loose, f"benchmark results belong under docs/results/: {loose}"


def test_results_hold_to_the_pages_rules():
    """One page per benchmark, each reached from docs/README.md with its JSON beside it, no path of the machine
    that ran it, no run from an uncommitted tree (bench/pages.py `check`, as `python -m vitserve.bench.pages check`)."""
    from vitserve.bench.pages import check

    problems = check(REPO / "docs")
    assert not problems, "\n".join(problems)


# The README's headline rows, by the server each names (bench/peers/config.py)
HEADLINE_SERVERS = {"**vitserve**": "vitserve", "Triton 2.51, Python backend, ONNX Runtime": "triton",
                    "Triton 2.51, Python backend, OpenVINO": "triton-bf16", "the 20-line FastAPI app": "fastapi"}


def test_the_readmes_headline_table_is_the_run_its_page_holds():
    """Every figure of the README's speed table and its command are those of docs/results/bench-peers.md's
    `vit-s16-headline` section (a rerun filed there and not copied to the README fails here)."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## How fast, against what", 1)[1].split("\n## ", 1)[0]
    run = json.loads((REPO / "docs" / "results" / "bench-peers.json").read_text())["sections"]["vit-s16-headline"]
    summary = {e["connections"]: e for e in run["models"][0]["summary"] if e["path"] == "image"}
    rows = re.findall(r"^\| (.+?) \| ([\d,.]+) \| ([\d,.]+) \| ([\d,.]+) \| ([\d,.]+) \|", section, re.M)
    shown = {next(server for label, server in HEADLINE_SERVERS.items() if row[0].startswith(label)):
             [float(v.replace(",", "")) for v in row[1:]] for row in rows}
    assert "vitserve" in shown and "triton" in shown and "fastapi" in shown
    for server, (one_rate, one_p50, many_rate, many_p99) in shown.items():
        one, many = summary[1][server], summary[32][server]
        assert (one_rate, one_p50, many_rate) == (round(one["ok_per_s"], 1), round(one["p50_ms"], 1),
                                                  round(many["ok_per_s"], 1)), server
        assert many_p99 == round(many["p99_ms"]), server
    assert f"`{run['command'].split(' --out ')[0]}`" in " ".join(section.split())  # wrapped as the text is
    assert run["environment"]["uncommitted_files"] == 0
