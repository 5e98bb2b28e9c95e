"""bench/pages.py: a run filed into its benchmark's page as a section (appended, or replacing exactly its own), its
JSON keyed by section, machine paths made portable, a run from an uncommitted tree refused, and the rules checked."""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from vitserve.bench import pages
from vitserve.bench.pages import REPO, PageError, check, main, parse_page, portable, put

OPENING = "# The benchmark\n\nWhat it measures, by hand.\n\nThe command: `python -m vitserve.bench.x`.\n"
LIBDIR = "$(python3 -c 'import sysconfig; print(sysconfig.get_config_var(\"LIBDIR\"))')"


def run_page(folder: Path, name: str, body: str, data: dict | None = None, title: str = "A run") -> Path:
    """A run's page as a benchmark command writes it, its JSON beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    run = folder / f"{name}.md"
    run.write_text(f"# {title}\n\n{body}\n\n## Every round\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    if data is not None:
        run.with_suffix(".json").write_text(json.dumps(data))
    return run


@pytest.fixture
def page(tmp_path) -> Path:
    path = tmp_path / "results" / "bench-x.md"
    path.parent.mkdir()
    path.write_text(OPENING)
    return path


def test_put_appends_a_section_under_the_hand_written_opening(page, tmp_path):
    put(page, "first", run_page(tmp_path / "runs", "one", "`cmd one`", {"n": 1}))
    put(page, "second", run_page(tmp_path / "runs", "two", "`cmd two`", {"n": 2}), title="the second")
    text = page.read_text()
    assert text.startswith(OPENING.rstrip() + "\n\n<!-- sections -->\n"
                           "- [first](#first): A run\n- [second](#second): the second\n<!-- /sections -->\n")
    assert [s.name for s in parse_page(text).sections] == ["first", "second"]
    first = parse_page(text).sections[0].text
    assert first == ('<!-- section: first -->\n<a id="first"></a>\n\n## first: A run\n\n`cmd one`\n\n'
                     "### Every round\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n<!-- /section -->\n")
    assert json.loads(page.with_suffix(".json").read_text()) == {"sections": {"first": {"n": 1}, "second": {"n": 2}}}


def test_put_replaces_only_its_own_section(page, tmp_path):
    runs = tmp_path / "runs"
    put(page, "first", run_page(runs, "one", "`cmd one`", {"n": 1}))
    put(page, "second", run_page(runs, "two", "`cmd two`", {"n": 2}))
    put(page, "third", run_page(runs, "three", "`cmd three`", {"n": 3}))
    before = parse_page(page.read_text())
    put(page, "second", run_page(runs, "two-again", "`cmd two, again`", {"n": 22}, title="Again"))
    after = parse_page(page.read_text())
    assert [s.name for s in after.sections] == ["first", "second", "third"]
    assert after.sections[0] == before.sections[0] and after.sections[2] == before.sections[2]
    assert "`cmd two, again`" in after.sections[1].text and "`cmd two`\n" not in after.sections[1].text
    assert after.opening.startswith(OPENING.rstrip()) and "- [second](#second): Again" in after.opening
    assert json.loads(page.with_suffix(".json").read_text())["sections"] == {"first": {"n": 1}, "second": {"n": 22},
                                                                             "third": {"n": 3}}


def test_first_places_a_new_section_first_and_a_run_without_json_has_no_entry(page, tmp_path):
    put(page, "old", run_page(tmp_path / "runs", "old", "`old`", {"n": 1}))
    put(page, "new", run_page(tmp_path / "runs", "new", "`new`"), first=True)
    assert [s.name for s in parse_page(page.read_text()).sections] == ["new", "old"]
    assert json.loads(page.with_suffix(".json").read_text()) == {"sections": {"old": {"n": 1}}}


def test_headings_go_one_level_down_but_not_in_fenced_code(page, tmp_path):
    run = run_page(tmp_path / "runs", "r", "```bash\n# a shell comment\n```\n\n### Deeper")
    put(page, "r", run)
    body = parse_page(page.read_text()).sections[0].text
    assert "## r: A run\n" in body and "### Every round" in body and "#### Deeper" in body
    assert "\n# a shell comment\n" in body


def test_machine_paths_become_portable_in_page_and_json(page, tmp_path):
    home, library = str(Path.home()), sysconfig.get_config_var("LIBDIR")
    body = (f"`{REPO}/.venv/bin/python --model {REPO}/models/m.onnx --checkout {REPO} --checkout /tmp/base0`, "
            f"LD_LIBRARY_PATH={library} {home}/.cache/x /home/someone/y https://example.com/home/z")
    data = {"argv": [f"{REPO}/.venv/bin/python", f"{library}/libpython3.so", "/tmp/vs-head"]}
    put(page, "r", run_page(tmp_path / "runs", "r", body, data))
    text = page.read_text()
    assert ("`.venv/bin/python --model models/m.onnx --checkout . --checkout $TMPDIR/base0`, "
            f"LD_LIBRARY_PATH={LIBDIR} ~/.cache/x ~/y https://example.com/home/z") in text
    assert json.loads(page.with_suffix(".json").read_text())["sections"]["r"] == {
        "argv": [".venv/bin/python", f"{LIBDIR}/libpython3.so", "$TMPDIR/vs-head"]}
    assert pages.machine_paths(text) == []


def test_portable_leaves_longer_names_and_relative_paths_alone():
    root = Path("/srv/checkout")  # not under a home or temporary folder, wherever this checkout is
    assert portable(f"{root}-other/x build/tmp/y {root}", root) == f"{root}-other/x build/tmp/y ."


@pytest.mark.parametrize("data, body", [
    ({"environment": {"uncommitted_files": 6}}, "`cmd`"),
    ({"servers": [{"uncommitted_files": 0}, {"uncommitted_files": 1}]}, "`cmd`"),
    (None, "`cmd`, commit `abc` with 4 uncommitted file(s) in the working tree (vitserve ran with them)"),
])
def test_a_run_from_an_uncommitted_tree_is_refused(page, tmp_path, capsys, data, body):
    run = run_page(tmp_path / "runs", "r", body, data)
    assert main(["put", str(page), "--section", "r", str(run)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("pages: refused") and "uncommitted" in error and error.count("\n") == 1
    assert page.read_text() == OPENING and not page.with_suffix(".json").exists()
    assert main(["put", str(page), "--section", "r", str(run), "--allow-uncommitted"]) == 0
    assert "<!-- section: r -->" in page.read_text()


def test_allow_uncommitted_is_never_for_docs(tmp_path):
    run = run_page(tmp_path, "r", "`cmd`", {"environment": {"uncommitted_files": 1}})
    with pytest.raises(PageError, match="never for docs/"):
        put(REPO / "docs" / "results" / "bench-scratch.md", "r", run, allow_uncommitted=True)
    assert not (REPO / "docs" / "results" / "bench-scratch.md").exists()


def test_text_outside_a_section_is_an_error_not_dropped(page, tmp_path):
    put(page, "r", run_page(tmp_path / "runs", "r", "`cmd`"))
    page.write_text(page.read_text() + "\nA stray paragraph.\n")
    with pytest.raises(PageError, match="outside a section"):
        put(page, "s", run_page(tmp_path / "runs", "s", "`cmd`"))


def test_a_bad_section_name_and_a_page_as_a_run_are_refused(page, tmp_path):
    with pytest.raises(PageError, match="section name"):
        put(page, "Has Spaces", run_page(tmp_path / "runs", "r", "`cmd`"))
    put(page, "r", run_page(tmp_path / "runs", "r", "`cmd`"))
    with pytest.raises(PageError, match="page of sections"):
        put(tmp_path / "other.md", "r", page)


def test_an_image_the_run_shows_is_copied_beside_the_page(page, tmp_path):
    run = run_page(tmp_path / "runs", "r", "![latency vs throughput](r.png)")
    (tmp_path / "runs" / "r.png").write_bytes(b"png")
    put(page, "vit-s16", run)
    assert "![latency vs throughput](bench-x-vit-s16.png)" in page.read_text()
    assert (page.parent / "bench-x-vit-s16.png").read_bytes() == b"png"


def docs_tree(root: Path) -> Path:
    """A docs folder that holds to the rules: README linking the one page, its JSON beside it. Named `site`, so that
    the paths below are not taken for the repository's own (tests/test_docs.py)."""
    docs = root / "site"
    (docs / "results").mkdir(parents=True)
    (docs / "README.md").write_text("| [bench-a.md](results/bench-a.md) | what | `cmd` |\n")
    (docs / "results" / "bench-a.md").write_text("# A\n\n`python -m vitserve.bench.a`, see https://example.com/tmp/\n")
    (docs / "results" / "bench-a.json").write_text(json.dumps({"sections": {"a": {"uncommitted_files": 0}}}))
    return docs


def test_check_passes_a_docs_tree_that_holds_to_the_rules(tmp_path, capsys):
    docs = docs_tree(tmp_path)
    assert check(docs) == []
    assert main(["check", str(docs)]) == 0


def test_check_finds_an_unlinked_page_and_a_missing_json(tmp_path, capsys):
    docs = docs_tree(tmp_path)
    (docs / "results" / "bench-b.md").write_text("# B\n")
    assert check(docs) == ["site/results/bench-b.md: not linked from site/README.md",
                           "site/results/bench-b.md: no bench-b.json beside it"]
    assert main(["check", str(docs)]) == 1
    assert "not linked" in capsys.readouterr().out


def test_check_finds_machine_paths_and_uncommitted_runs(tmp_path):
    docs = docs_tree(tmp_path)
    (docs / "results" / "bench-a.md").write_text("# A\n\n`--model /work/main/m.onnx`, 2 uncommitted file(s)\n")
    (docs / "results" / "bench-a.json").write_text(json.dumps(
        {"sections": {"a": {"python": "/root/.pyenv/bin/python", "servers": [{"uncommitted_files": 2}]}}}))
    assert check(docs) == [
        "site/results/bench-a.md: a machine path, line 3: /work/main/m.onnx",
        "site/results/bench-a.md: a run from an uncommitted tree ('uncommitted file(s)')",
        "site/results/bench-a.json: a machine path, line 1: /root/.pyenv/bin/python",
        "site/results/bench-a.json: a run from an uncommitted tree (2 uncommitted file(s))"]


@pytest.mark.parametrize("text, found", [
    ("/tmp/base0", ["/tmp/base0"]),
    ("(/home/me/x.md)", ["/home/me/x.md"]),
    ("/usr/lib/python3/dist-packages/onnx", ["/usr/lib/python3/dist-packages/onnx"]),
    ("https://host/tmp/x file:///work/y", []),
    ("~/x $TMPDIR/y build/tmp/z .venv/lib/python3.11/site-packages/onnx", []),
    (f"{LIBDIR}/libpython3.so", []),
])
def test_machine_path_patterns(text, found):
    assert [p.split(": ", 1)[1] for p in pages.machine_paths(text)] == found
