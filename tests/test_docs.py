"""The documentation stays true to the code (issue 26 point 2).

README.md is what a newcomer reads in ten minutes; the reference lives in docs/. These tests fail when the code
grows what the pages do not say, or the pages keep what the code dropped:

- every option of ``EcqSettings`` (nested settings models included) has a row in docs/configuration.md's options
  table, and every row there names an option;
- every ``ecq`` command and subcommand (the click group walked recursively: ``pipeline``, ``cluster``) appears in
  docs/operations.md as ```ecq <path>``, and every ```ecq <word>`` in README.md and docs/ names a real command;
- every admin API route and every Prometheus metric appears in docs/operations.md;
- README.md is under 200 lines and links every page of docs/;
- every relative link of README.md and docs/*.md points at a file that exists, and at a heading that exists
  when it names one (``page.md#anchor``, GitHub's anchors).

No broker is started: the tests read the code's own models, click group, routes and metric registry.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path

import click
import pytest
from pydantic import BaseModel

from ecq.cli import main
from ecq.config import EcqSettings

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
README = REPO / "README.md"
CONFIGURATION = DOCS / "configuration.md"
OPERATIONS = DOCS / "operations.md"
README_MAX_LINES = 200

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/ (examples included, if any are Markdown)."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def prose(text: str) -> str:
    """``text`` without fenced code blocks, indented code blocks and inline code: where Markdown links live."""
    text = _FENCE.sub("", text)
    text = "\n".join(line for line in text.splitlines() if not line.startswith("    "))
    return _INLINE_CODE.sub("", text)


def links(path: Path) -> list[str]:
    """The link targets of a Markdown page, outside code."""
    return _LINK.findall(prose(path.read_text()))


def is_relative(target: str) -> bool:
    """True for a link into this repository (no scheme such as ``https:``, ``mailto:``)."""
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)


def github_anchors(path: Path) -> set[str]:
    """The anchors GitHub makes for the headings of a Markdown page: lower case, punctuation dropped, spaces to
    hyphens, ``-1``, ``-2``, ... for repeats."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for line in _FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


# --- options ---------------------------------------------------------------------------------------------------

def settings_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every field of a settings model, nested models' fields as ``outer.inner`` (and ``outer`` itself)."""
    names = []
    for name, field in model.model_fields.items():
        names.append(prefix + name)
        for inner in _models_in(field.annotation):
            names += settings_fields(inner, f"{prefix}{name}.")
    return names


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in _models_in(arg)]


def section(path: Path, heading: str) -> str:
    """The text of a page from ``heading`` (a whole heading line) to the next heading of the same or a higher level."""
    text = path.read_text()
    level = len(heading) - len(heading.lstrip("#"))
    start = text.index(heading + "\n")
    rest = text[start + len(heading) + 1:]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[:end.start()] if end else rest


def option_rows(text: str) -> set[str]:
    """The option names in the first cell of each table row of ``text`` (```a```, or ```a`, `b``` for several)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            names.update(re.findall(r"`([^`]+)`", first_cell))
    return names


def test_every_option_has_a_row_in_the_configuration_page():
    documented = option_rows(section(CONFIGURATION, "## Plugin options"))
    missing = [name for name in settings_fields(EcqSettings) if name not in documented]
    assert not missing, f"options of EcqSettings with no row in {CONFIGURATION.relative_to(REPO)}: {missing}"


def test_every_row_of_the_options_table_is_an_option():
    documented = option_rows(section(CONFIGURATION, "## Plugin options"))
    stale = sorted(documented - set(settings_fields(EcqSettings)))
    assert not stale, f"rows of {CONFIGURATION.relative_to(REPO)} naming no option of EcqSettings: {stale}"


# --- commands --------------------------------------------------------------------------------------------------

def command_paths(group: click.Group = main, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command and group under ``group`` as its path of names, depth first."""
    paths = []
    for name, command in sorted(group.commands.items()):
        paths.append(prefix + (name,))
        if isinstance(command, click.Group):
            paths += command_paths(command, prefix + (name,))
    return paths


def test_the_command_walk_sees_the_groups():
    paths = command_paths()
    assert ("pipeline", "report") in paths and ("cluster", "rebalance") in paths and ("broker",) in paths


def test_every_command_appears_in_the_operations_page():
    text = OPERATIONS.read_text()
    missing = [" ".join(path) for path in command_paths()
               if not re.search(r"`ecq " + re.escape(" ".join(path)) + r"(?=[\s`])", text)]
    assert not missing, f"ecq commands not shown as `ecq <command>` in {OPERATIONS.relative_to(REPO)}: {missing}"


def test_every_ecq_command_the_pages_name_exists():
    """```ecq WORD ...`` in README.md or docs/: WORD (and any subcommand word after a group) is a command, an option
    (``--version``) or a placeholder (``COMMAND``)."""
    stale = []
    for page in pages():
        for span in re.findall(r"`(ecq [^`]+)`", _FENCE.sub("", page.read_text())):
            group: click.Command = main
            for word in span.split()[1:]:
                if not isinstance(group, click.Group) or not re.fullmatch(r"[a-z][a-z-]*", word):
                    break
                if word not in group.commands:
                    stale.append(f"{page.relative_to(REPO)}: `{span}`")
                    break
                group = group.commands[word]
    assert not stale, f"pages name ecq commands that do not exist: {stale}"


# --- admin API and metrics -------------------------------------------------------------------------------------

def admin_routes() -> list[tuple[str, str]]:
    """(method, path) of every API route the admin API serves, read from the route tables in ecq/ops/ (admin.py's,
    dashboard.py's JSON route; the dashboard's static files are named in its own section)."""
    source = "\n".join(path.read_text() for path in sorted((REPO / "ecq" / "ops").glob("*.py")))
    routes = re.findall(r"(?:web\.|router\.add_)(get|post|put|delete|patch)\(\"([^\"]+)\"", source)
    assert routes, "no route found in ecq/ops/: has the route table moved?"
    return [(method.upper(), path) for method, path in routes]


def test_every_admin_route_appears_in_the_operations_page():
    text = OPERATIONS.read_text()
    missing = []
    for method, path in admin_routes():
        shown = re.sub(r"\{(\w+)\}", lambda m: m.group(1).upper(), path)  # {clientid} is written CLIENTID
        if not re.search(rf"{method} {re.escape(shown)}(?=[\s`?])", text):
            missing.append(f"{method} {shown}")
    assert not missing, f"admin API routes not in {OPERATIONS.relative_to(REPO)}: {missing}"


class _NoLag:
    """Enough of a LagIndex for the lag collector to describe its metrics."""

    def totals(self):
        return 0, 0.0

    def pending_counts(self):
        return []

    def scq_totals(self):
        return 0, 0


def metric_names() -> list[str]:
    """Every metric a broker can serve (the cluster's included), as Prometheus shows it: counters with ``_total``."""
    from ecq.ops.metrics import _GAUGE_HELP, EcqMetrics

    metrics = EcqMetrics({name: (lambda: 0.0) for name in _GAUGE_HELP}, cluster=True)
    metrics.watch_lag(_NoLag(), lambda: 0)
    metrics.watch_streams(lambda: None, lambda: True)
    names = []
    for family in metrics.registry.collect():
        names.append(family.name + "_total" if family.type == "counter" else family.name)
    return names


def test_every_metric_appears_in_the_operations_page():
    text = OPERATIONS.read_text()
    names = metric_names()
    assert "ecq_writes_accepted_total" in names and "ecq_stream_leader" in names
    missing = [name for name in names if not re.search(rf"`{name}(?=[`{{])", text)]
    assert not missing, f"metrics not in {OPERATIONS.relative_to(REPO)}: {missing}"


# --- README and links ------------------------------------------------------------------------------------------

def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; keep it under {README_MAX_LINES}: move the rest " \
                                     "to docs/"


def test_readme_links_every_docs_page():
    linked = {(README.parent / target.split("#")[0]).resolve() for target in links(README) if is_relative(target)}
    missing = [str(page.relative_to(REPO)) for page in sorted(DOCS.glob("*.md")) if page.resolve() not in linked]
    assert not missing, f"docs pages README.md does not link: {missing}"


@pytest.mark.parametrize("page", pages(), ids=lambda page: str(page.relative_to(REPO)))
def test_relative_links_point_at_what_exists(page):
    broken = []
    for target in links(page):
        if not is_relative(target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in github_anchors(linked):
            broken.append(f"{target} (no heading with that anchor in {linked.relative_to(REPO)})")
    assert not broken, f"broken links in {page.relative_to(REPO)}: {broken}"
