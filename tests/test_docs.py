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


def test_every_make_target_the_readme_shows_is_the_makefiles():
    """Every `make` target the README shows is one the Makefile has (or a card's own target)."""
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z.-]*):", makefile, re.M))
    targets |= {p.stem for p in (REPO / "pipelines/models").glob("*.yaml")}  # `make <model>`, one per card
    shown = set(re.findall(r"`make ([a-z][a-z0-9.-]*)", (REPO / "README.md").read_text()))
    assert {"run", "test", "speed-at-shape"} <= shown
    assert shown <= targets, f"the README shows make targets the Makefile lacks: {sorted(shown - targets)}"


def test_every_section_cited_by_name_exists():
    """`README, "Running as a team"` or `docs/toolchain.md, "vLLM on a CPU"` in a comment, docstring, card or
    doc names a heading of that file: a renamed heading leaves the citation pointing nowhere."""
    cite = re.compile(r'((?:[\w-]+/)?README(?:\.md)?|docs/[\w-]+\.md), "([^"]+)"')
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
            target = REPO / (doc if doc.endswith(".md") else doc + ".md")  # README, or refmodel/README.md
            headings = [line.lstrip("#").strip() for line in target.read_text().splitlines() if line.startswith("#")]
            seen += 1
            if not any(h == heading or h.startswith(heading + " (") or h.startswith(heading + ": ") for h in headings):
                missing.append(f"{place.relative_to(REPO)}: {doc}, {heading!r}")
    assert seen > 5 and missing == []


def test_the_front_page_stays_short_and_dated_figures_live_on_the_results_page():
    """README.md is the product's front page (issue 42: it had grown to 107 KB of run logs); a commit or a
    date beside a figure belongs to docs/results.md, which is replaced, not appended to, on each run."""
    assert len((REPO / "README.md").read_bytes()) < 25_000
    dated = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b|\b20\d\d-\d\d-\d\d\b")
    pages = [REPO / "README.md", REPO / "refmodel/README.md", *(REPO / "docs").glob("*.md")]
    found = [
        f"{p.relative_to(REPO)}:{n}: {m.group()}"
        for p in pages
        if p.name != "results.md"
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if (m := dated.search(line))
    ]
    assert found == []


def test_the_readmes_card_is_a_valid_card(tmp_path):
    from pipelines.core.card.cards import parse_card

    text = (REPO / "README.md").read_text()
    shown = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert shown, "the README shows no card"
    name = re.search(r"^name: (\S+)$", shown.group(1), re.M).group(1)
    (tmp_path / f"{name}.yaml").write_text(shown.group(1))
    card = parse_card(tmp_path / f"{name}.yaml")
    assert card.source.hub_id and card.precisions[0] == card.gate.baseline


def test_the_readmes_precision_table_lists_every_precision_where_the_kernel_table_runs_it():
    from pipelines.cli_kernels import natively
    from quant.precisions import PRECISIONS

    text = (REPO / "README.md").read_text()
    table = text[text.index("## Precisions") :].split("\n\n")[1]
    rows = {
        cells[0].strip("` "): cells[-1].strip() for line in table.splitlines()[2:] if (cells := line.split("|")[1:-1])
    }
    assert rows == {name: natively(name) for name in PRECISIONS}
