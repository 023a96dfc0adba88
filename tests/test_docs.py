"""The docs against the code: every option the README shows for a command exists, and what it says every
command takes, every command takes (issue 41: `qeval size --force` was "No such option" where the README
said every command took it); every section the code and docs cite by name exists (issue 42)."""

from __future__ import annotations

import re

from helpers import REPO


def _options() -> dict[str, set[str]]:
    import typer

    from pipelines.cli import app

    group = typer.main.get_command(app)
    return {name: {o for p in c.params for o in (*p.opts, *p.secondary_opts)} for name, c in group.commands.items()}


def test_every_option_the_readme_shows_is_the_commands_own():
    options, shown = _options(), 0
    for line in (REPO / "README.md").read_text().splitlines():
        for call in re.findall(r"`qeval ([a-z]+)((?: [^`|]*)?)`", line):
            name, rest = call
            assert name in options, f"README shows `qeval {name}`, which is no command"
            for opt in re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", rest):
                shown += 1
                assert opt in options[name], f"README shows `qeval {name} ... {opt}`, which it does not take"
    assert shown > 20  # the table was read


def test_what_the_readme_says_commands_take_they_take():
    options, text = _options(), (REPO / "README.md").read_text()
    said = re.search(r"`--force` is taken by ([^.]+)\.", text)
    assert said, "the README no longer says which commands take --force"
    named = set(re.findall(r"`([a-z]+)`", said.group(1)))
    assert named == {n for n, opts in options.items() if "--force" in opts}
    json_said = re.search(r"Every command but (.+?) takes\s+`--json`", text)
    assert json_said, "the README no longer says which commands take --json"
    without = set(re.findall(r"`([a-z]+)`", json_said.group(1)))
    assert without == {n for n, opts in options.items() if "--json" not in opts}


def test_every_section_cited_by_name_exists():
    """`README, "Running as a team"` or `docs/toolchain.md, "vLLM on a CPU"` in a comment, docstring, card or
    doc names a heading of that file: a renamed heading leaves the citation pointing nowhere."""
    cite = re.compile(r'(README|README\.md|docs/[\w-]+\.md), "([^"]+)"')
    places = [
        REPO / "Makefile",
        *REPO.glob("*.md"),
        *(REPO / "docs").glob("*.md"),
        *(REPO / "pipelines/models").glob("*.yaml"),
    ]
    places += [
        p for top in ("pipelines", "eval", "quant", "refmodel", "scripts", "tests") for p in (REPO / top).rglob("*.py")
    ]
    missing, seen = [], 0
    for place in places:
        for doc, cited in cite.findall(place.read_text()):
            heading = " ".join(cited.split())  # a citation may wrap across lines
            target = REPO / ("README.md" if doc.startswith("README") else doc)
            headings = [line.lstrip("#").strip() for line in target.read_text().splitlines() if line.startswith("#")]
            seen += 1
            if not any(h == heading or h.startswith(heading + " (") or h.startswith(heading + ": ") for h in headings):
                missing.append(f"{place.relative_to(REPO)}: {doc}, {heading!r}")
    assert seen > 5 and missing == []
