"""`python -m vitserve.bench.pages`: one page per benchmark under docs/results/, each run of it a section.

    python -m vitserve.bench.pages put docs/results/bench-peers.md --section vit-s16 build/bench/peers-vit-s16.md
    python -m vitserve.bench.pages check            # docs/ against the rules below (tests/test_docs.py runs it)

A benchmark command writes one run's page (RUN.md, its JSON beside it). `put` files that run into the benchmark's
page (PAGE.md) as the section NAME: the section of that name replaced where it is, or a new one appended (`--first`:
placed first). The run's title becomes the heading `## NAME: <title>` (`--title` gives another), its own headings
go one level down, and its JSON becomes `sections[NAME]` of PAGE.json. The page's opening, everything above its
first section (the title, what the benchmark measures, the command), is written by hand and kept as it is, but
for the list of sections in it (between `<!-- sections -->` and `<!-- /sections -->`, added at the opening's end
when absent), which follows the sections. An image the run shows is copied beside the page as
`<page>-<NAME>.png`.

On the way in, the paths of the machine that ran it become ones that hold on any other: the checkout's root
relative, the base Python's library folder as the command that prints it, home folders `~`, the temporary folder
`$TMPDIR` (`portable`, which bench/peers/run.py also gives the commands its reports print). A run made from a tree
with uncommitted changes is refused (exit status 2): a page's figures are those of a commit that anyone can check
out. `--allow-uncommitted` files one anyway, for a scratch page outside docs/.

`check` holds docs/ to the same rules: every page in docs/results/ linked from docs/README.md, its JSON beside it,
no machine path in a page or a JSON, no run from an uncommitted tree. Git keeps the runs a page no longer shows.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

NAME = re.compile(r"[a-z0-9][a-z0-9-]*")  # a section's name is also its anchor: lower case, digits, hyphens
SECTION = re.compile(r"^<!-- section: (?P<name>\S+) -->\n(?P<body>.*?)^<!-- /section -->(?:\n|\Z)", re.M | re.S)
SECTION_MARK = re.compile(r"^<!-- /?section(: \S+)? -->$", re.M)
INDEX = re.compile(r"<!-- sections -->\n.*?<!-- /sections -->", re.S)
HEADING = re.compile(r"^(#{1,5}) ", re.M)
IMAGE = re.compile(r"!\[(?P<alt>[^\]]*)\]\((?P<target>[^)\s:]+\.(?:png|svg|jpg))\)")
LINK = re.compile(r"\]\(([^)\s]+)\)")

# A path that only exists on the machine that ran the benchmark: a checkout, a home or temporary folder, an
# installed package. The look-behind keeps URLs (`https://host/home/...`), relative paths (`build/tmp/...`) and the
# portable forms (`~/...`, `$TMPDIR/...`, `$(python3 ...)/...`) out of it.
MACHINE_PATH = re.compile(r"(?<![\w.~$:/-])(?:/(?:work|root|home|tmp|Users)/[^\s\"'`)|,;]*"
                          r"|/[^\s\"'`)|,;]*/(?:site|dist)-packages\b[^\s\"'`)|,;]*)")
UNCOMMITTED = re.compile(r"\buncommitted (?:file\(s\)|files?\b|changes\b)")

# Pages whose runs left no JSON, each with why. A rerun with --out and `put` gives the page one; until then the
# page is the record, and nothing checks its figures against data.
WITHOUT_JSON = {
    # written by hand from several runs of bench/engine_ceiling.py on three machines, printed, not --out
    "bench-engine-ceiling.md",
    # evaluation/embeddings.py writes its report as Markdown only
    "embeddings-bf16.md",
    # bench/ipc_round_trip.py's printed report, run without --out
    "ipc-round-trip.md",
}


class PageError(Exception):
    """A page, a run or a name that `put` cannot use; the message says which and why."""


@dataclass
class Section:
    name: str
    title: str
    text: str  # the whole block, its markers included


@dataclass
class Page:
    opening: str  # above the first section, written by hand
    sections: list[Section] = field(default_factory=list)

    def put(self, section: Section, first: bool = False) -> None:
        """`section` in place of the one of its name, or added (first or last)."""
        for i, old in enumerate(self.sections):
            if old.name == section.name:
                self.sections[i] = section
                return
        self.sections.insert(0 if first else len(self.sections), section)

    def render(self) -> str:
        index = "\n".join(["<!-- sections -->", *(f"- [{s.name}](#{s.name}): {s.title}" for s in self.sections),
                           "<!-- /sections -->"])
        opening = INDEX.sub(lambda _: index, self.opening) if INDEX.search(self.opening) \
            else self.opening.rstrip() + "\n\n" + index + "\n"
        return "\n".join([opening.rstrip() + "\n", *(s.text for s in self.sections)])


def parse_page(text: str) -> Page:
    """A page as its opening and its sections; text between or after sections is an error, not dropped."""
    matches = list(SECTION.finditer(text))
    ends = [matches[0].start() if matches else len(text), *(m.end() for m in matches)]
    starts = [m.start() for m in matches[1:]] + [len(text)]
    for end, start in zip(ends[1:], starts):
        if text[end:start].strip():
            line = text.count("\n", 0, end) + 1
            raise PageError(f"text outside a section at line {line}: {text[end:start].strip()[:60]!r}")
    sections = [Section(m["name"], _section_title(m["body"], m["name"]), m.group(0).rstrip("\n") + "\n")
                for m in matches]
    if len({s.name for s in sections}) < len(sections):
        raise PageError("two sections of the same name")
    return Page(text[:ends[0]], sections)


def _section_title(body: str, name: str) -> str:
    heading = re.search(rf"^## {re.escape(name)}: (.*)$", body, re.M)
    return heading[1] if heading else name


def make_section(name: str, run_text: str, title: str | None = None) -> Section:
    """The run's page as the section `name`: its title (the first line, when a `# ` heading) in the section's
    heading, its other headings one level down, fenced code left as it is."""
    lines = run_text.strip("\n").splitlines()
    run_title = lines.pop(0)[2:].strip() if lines and lines[0].startswith("# ") else None
    fenced = False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and HEADING.match(line):
            lines[i] = "#" + line
    title = title or run_title or name
    body = "\n".join(lines).strip("\n")
    text = (f"<!-- section: {name} -->\n<a id=\"{name}\"></a>\n\n## {name}: {title}\n\n{body}\n\n"
            "<!-- /section -->\n")
    return Section(name, title, text)


def _replace_path(text: str, path: str, by: str) -> str:
    """`path` as a whole path (not the start of a longer name) replaced by `by`; `path/` by `by/`, or by nothing
    when `by` is the empty string."""
    if not path or path == "/":
        return text
    text = re.sub(re.escape(path) + "/", lambda _: by + "/" if by else "", text)
    return re.sub(re.escape(path) + r"(?![\w.-])", lambda _: by or ".", text)


def portable(text: str, root: Path = REPO) -> str:
    """`text` with the running machine's paths as ones that hold anywhere: the checkout's root relative, the base
    Python's library folder as the command that prints it, home folders `~`, the temporary folder `$TMPDIR`."""
    text = _replace_path(text, str(root), "")
    library = sysconfig.get_config_var("LIBDIR")
    if library:
        text = _replace_path(text, library,
                             "$(python3 -c 'import sysconfig; print(sysconfig.get_config_var(\"LIBDIR\"))')")
    text = _replace_path(text, str(Path.home()), "~")
    text = re.sub(r"(?<![\w.~$:/-])(?:/root|/home/[^/\s\"'`]+|/Users/[^/\s\"'`]+)(?=/|\b)", "~", text)
    for temporary in dict.fromkeys(["/tmp", tempfile.gettempdir()]):
        text = re.sub(r"(?<![\w.~$:/-])" + re.escape(temporary) + "(?=/)", "$TMPDIR", text)
    return text


def portable_data(data, root: Path = REPO):
    """A run's JSON with `portable` applied to every string in it."""
    if isinstance(data, str):
        return portable(data, root)
    if isinstance(data, list):
        return [portable_data(v, root) for v in data]
    if isinstance(data, dict):
        return {k: portable_data(v, root) for k, v in data.items()}
    return data


def uncommitted_files(data) -> int:
    """The most uncommitted files any part of a run's JSON records (`environment` for peers, `servers` for the
    modes of `vitserve bench`)."""
    if isinstance(data, dict):
        own = data.get("uncommitted_files")
        found = [own if isinstance(own, int) else 0, *(uncommitted_files(v) for v in data.values())]
        return max(found)
    if isinstance(data, list):
        return max((uncommitted_files(v) for v in data), default=0)
    return 0


def uncommitted(run_text: str, data) -> str | None:
    """Why a run is not from a committed tree, or None."""
    if data is not None and (count := uncommitted_files(data)):
        return f"its JSON records {count} uncommitted file(s)"
    if said := UNCOMMITTED.search(run_text):
        return f"its page says '{said[0]}'"
    return None


def copy_images(run_text: str, run_dir: Path, page: Path, name: str) -> str:
    """Each image the run shows from beside it copied beside the page as `<page>-<name><suffix>`, the reference
    following it."""
    def copy(m: re.Match) -> str:
        source = run_dir / m["target"]
        if not source.is_file():
            return m.group(0)
        target = page.parent / f"{page.stem}-{name}{source.suffix}"
        if source.resolve() != target.resolve():
            shutil.copyfile(source, target)
        return f"![{m['alt']}]({target.name})"
    return IMAGE.sub(copy, run_text)


def read_page_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or set(data) != {"sections"} or not isinstance(data["sections"], dict):
        raise PageError(f"{path} is not a page's JSON ({{\"sections\": {{NAME: run, ...}}}})")
    return data["sections"]


def put(page: Path, name: str, run: Path, *, title: str | None = None, first: bool = False,
        allow_uncommitted: bool = False) -> None:
    """File the run `run` (its JSON beside it, when there is one) into `page` as the section `name`."""
    if not NAME.fullmatch(name):
        raise PageError(f"section name {name!r}: lower-case letters, digits and hyphens (it is the anchor)")
    if allow_uncommitted and page.resolve().is_relative_to(REPO / "docs"):
        raise PageError("--allow-uncommitted is for scratch pages, never for docs/")
    run_text = run.read_text()
    run_json = run.with_suffix(".json")
    data = json.loads(run_json.read_text()) if run_json.is_file() else None
    if not allow_uncommitted and (why := uncommitted(run_text, data)):
        raise PageError(f"refused {run}: {why}; run it again from a committed tree")
    if SECTION_MARK.search(run_text):
        raise PageError(f"{run} is a page of sections, not one run's page")
    page.parent.mkdir(parents=True, exist_ok=True)
    section = make_section(name, portable(copy_images(run_text, run.parent, page, name)), title)
    current = parse_page(page.read_text()) if page.is_file() else Page(f"# {section.title}\n")
    runs = read_page_json(page.with_suffix(".json"))
    current.put(section, first)
    if data is None:
        runs.pop(name, None)
    else:
        runs[name] = portable_data(data)
    ordered = {s.name: runs[s.name] for s in current.sections if s.name in runs}
    page.write_text(current.render())
    page.with_suffix(".json").write_text(json.dumps({"sections": ordered}, indent=1) + "\n")


def linked_pages(readme: Path) -> set[Path]:
    """The files that `readme`'s relative links reach."""
    targets = (t.split("#", 1)[0] for t in LINK.findall(readme.read_text()) if not re.match(r"[a-z]+:", t))
    return {(readme.parent / t).resolve() for t in targets if t}


def machine_paths(text: str) -> list[str]:
    return [f"line {text.count(chr(10), 0, m.start()) + 1}: {m[0]}" for m in MACHINE_PATH.finditer(text)]


def check(docs: Path) -> list[str]:
    """What in `docs` breaks the pages' rules, one line each; empty when nothing does."""
    docs = docs.resolve()
    results, problems = docs / "results", []
    linked = linked_pages(docs / "README.md") if (docs / "README.md").is_file() else set()
    for page in sorted(results.glob("*.md")):
        text, where = page.read_text(), f"{page.relative_to(docs.parent)}"
        if page.resolve() not in linked:
            problems.append(f"{where}: not linked from {docs.name}/README.md")
        if not page.with_suffix(".json").is_file() and page.name not in WITHOUT_JSON:
            problems.append(f"{where}: no {page.stem}.json beside it")
        problems += [f"{where}: a machine path, {p}" for p in machine_paths(text)]
        if said := UNCOMMITTED.search(text):
            problems.append(f"{where}: a run from an uncommitted tree ('{said[0]}')")
    for data in sorted(results.glob("*.json")):
        text, where = data.read_text(), f"{data.relative_to(docs.parent)}"
        problems += [f"{where}: a machine path, {p}" for p in machine_paths(text)]
        try:
            count = uncommitted_files(json.loads(text))
        except json.JSONDecodeError as e:
            problems.append(f"{where}: not JSON ({e})")
            continue
        if count:
            problems.append(f"{where}: a run from an uncommitted tree ({count} uncommitted file(s))")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vitserve.bench.pages", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    filing = commands.add_parser("put", help="file one run's page into a benchmark's page as a section")
    filing.add_argument("page", type=Path, help="the benchmark's page, e.g. docs/results/bench-peers.md")
    filing.add_argument("run", type=Path, help="the run's page as its command wrote it (its JSON beside it)")
    filing.add_argument("--section", required=True, help="the section's name and anchor, e.g. vit-s16")
    filing.add_argument("--title", help="the section's heading after its name (default: the run's title)")
    filing.add_argument("--first", action="store_true", help="a new section goes first (default: last)")
    filing.add_argument("--allow-uncommitted", action="store_true",
                        help="file a run from an uncommitted tree (a scratch page, never under docs/)")
    checking = commands.add_parser("check", help="docs/ against the pages' rules")
    checking.add_argument("docs", nargs="?", type=Path, default=REPO / "docs")
    args = parser.parse_args(argv)
    if args.command == "check":
        problems = check(args.docs)
        print("\n".join(problems) or f"{len(list((args.docs / 'results').glob('*.md')))} pages hold to the rules")
        return 1 if problems else 0
    try:
        put(args.page, args.section, args.run, title=args.title, first=args.first,
            allow_uncommitted=args.allow_uncommitted)
    except (PageError, OSError, json.JSONDecodeError) as e:
        print(f"pages: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
