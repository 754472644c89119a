"""The documentation: the generated reference pages match the code, every config key and CLI command is in them,
no page speaks of development rounds, the version matches the changelog, and the site builds with
`mkdocs build --strict` (broken links, anchors and pages fail it)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlanywhere import __version__, reference
from rlanywhere.cli import build_parser
from rlanywhere.config import schema_keys

ROOT = Path(__file__).resolve().parents[1]

# Wording about how the project was made rather than what it does: development rounds, issue numbers, goals met or
# missed, who measured what. History belongs in CHANGELOG.md and git, not in the pages.
DEVELOPMENT_WORDING = [
    r"\bsessions?\s+\d+",
    r"\b(this|that|earlier|previous|next|later|last|each|every|both)\s+sessions?\b",
    r"\bissues?\s*#?\d+",
    r"\b(development|dev)\s+rounds?\b",
    r"\brounds?\s+\d+\b",
    r"\bgoals?\b[^.\n]{0,40}\b(met|reached|missed)\b",
    r"\(goal\b",
    r"\bgoal\s+(of\s+)?[\d.,]+",
    r"\blanes?\b",
    r"\bsuperseded\b",
    r"\bthis (pr|ticket)\b",
    r"\b(measured|run|written) by (the )?(lead|agent|engineer)s?\b",
]


def doc_pages() -> list[Path]:
    """README and every Markdown page of the site (the changelog is history by design)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_committed_reference_pages_are_what_the_code_generates():
    for relative, text in reference.generated_pages(with_fits=False).items():
        committed = (ROOT / relative).read_text()
        assert committed == text, f"{relative} is out of date: run `python -m rlanywhere.reference`"


@pytest.mark.slow
def test_the_what_fits_table_is_what_the_planner_says_in_its_page_and_the_readme():
    pages = reference.generated_pages(with_fits=True)
    for relative in (reference.PAGES["hardware"], Path("README.md")):
        assert (ROOT / relative).read_text() == pages[relative], (
            f"{relative} is out of date: run `python -m rlanywhere.reference`")
    table = pages[reference.PAGES["hardware"]]
    assert table.count("\n| ") == len(reference.FIT_CARDS) + 1  # the header and one row per card
    p40 = next(line for line in table.splitlines() if line.startswith("| Tesla P40 |"))
    assert "fp32, no TF32" in p40 and "SDPA" in p40  # Pascal: no bf16, no TF32, no FlashAttention


def test_readme_keeps_one_what_fits_block():
    readme = (ROOT / "README.md").read_text()
    assert readme.count(reference.FITS_BEGIN) == 1 and readme.count(reference.FITS_END) == 1
    begin, end = reference.FITS_BEGIN, reference.FITS_END
    replaced = reference.readme_with_fits(f"a\n{begin}\nold\n{end}\nb", "| new |")
    assert replaced == f"a\n{begin}\n| new |\n{end}\nb"


def test_config_reference_lists_every_schema_key_with_a_description():
    keys = reference.config_keys()
    assert [info.key for info in keys] == schema_keys()
    undocumented = [info.key for info in keys if not (info.description or info.without_effect)]
    assert not undocumented, ("no description for " + ", ".join(undocumented) + ": add a comment on the key's line "
                              "in config.py or an entry in config_docs.KEY_DOCS")
    page = reference.config_reference()
    for key in schema_keys():
        section = reference._section_of(key)
        assert f"## `{section}`" in page and f"| `{key[len(section) + 1:]}` |" in page, key


def test_config_reference_shows_defaults_verl_names_and_notices():
    page = reference.config_reference()
    assert "| `train_batch_size` | int | `1024` | same |" in page
    assert "| `precision` | str | `auto` | none (rlanywhere) |" in page
    assert "`actor_rollout_ref.actor.fsdp_config.fsdp_size` (honoured as this key)" in page
    # a key accepted without effect says so, with the reason from the config module
    strategy_row = next(line for line in page.splitlines() if line.startswith("| `strategy` |"))
    assert "accepted, no effect" in strategy_row and "no FSDP/Megatron wrapper" in strategy_row
    # verl-only keys, made readable
    assert "- `ray_init*`: no Ray" in page


def test_key_descriptions_fall_back_to_the_comment_on_the_schema_line():
    from rlanywhere.config import HardwareConfig

    comments = reference._field_comments(HardwareConfig)
    assert comments["precision"] == "auto | fp32 | bf16 | fp16"
    assert comments["shard_group_size"].startswith("sharded: ranks per shard group")  # a comment block above


def test_cli_reference_lists_every_subcommand_and_option():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    page = reference.cli_reference()
    assert set(subparsers.choices) >= {"demo", "train", "plan", "doctor", "eval", "chat", "prepare", "plot"}
    for name, sub in subparsers.choices.items():
        assert f"## rlanywhere {name}\n" in page, name
        assert f"[`{name}`](#rlanywhere-{name})" in page, name
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help", "-v", "--verbose"):
                    assert f"`{flag}`" in page, (name, flag)


def test_table_cells_escape_pipes_and_links_outside_code():
    assert reference._cell("a | b [x] `[y]`") == "a \\| b \\[x\\] `[y]`"


@pytest.mark.parametrize("text, found", [
    ("measured in session 15", True), ("Sessions 12-14 were lent one GPU", True), ("(issue 16)", True),
    ("this session's device time", True), ("the ratios of earlier sessions", True), ("an ssh session dropped", False),
    ("goal 1.3x met", True), ("(goal 100,000: met)", True), ("the 1.8x goal is not met", True),
    ("the goal of 1.8x", True), ("your goal is a model that answers", False), ("measured by the lead", True),
    ("rounded up to 8", False), ("generation rounds a step", False), ("a round trip", False),
    ("round 3 of the work", True),
])
def test_development_wording_patterns(text, found):
    assert any(re.search(p, text, re.IGNORECASE) for p in DEVELOPMENT_WORDING) == found


def test_no_page_speaks_of_development_rounds():
    offenders = []
    for page in doc_pages():
        for number, line in enumerate(page.read_text().splitlines(), start=1):
            for pattern in DEVELOPMENT_WORDING:
                match = re.search(pattern, line, re.IGNORECASE)
                if match:
                    offenders.append(f"{page.relative_to(ROOT)}:{number}: {match.group(0)!r}")
    assert not offenders, "development-round wording in the docs (move history to CHANGELOG.md):\n" + "\n".join(
        offenders)


def test_version_matches_a_changelog_entry_and_the_cli():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(__version__)}\s*$", changelog, re.MULTILINE), __version__
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "rlanywhere.cli", "--version"], capture_output=True, text=True,
                         cwd=ROOT, check=True, env=env)  # this checkout, not whatever copy is installed
    assert out.stdout.strip() == f"rlanywhere {__version__}"
    assert 'dynamic = ["version"]' in (ROOT / "pyproject.toml").read_text()  # pyproject reads __version__


def test_every_page_is_in_the_navigation():
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", "#"))["nav"]

    def pages(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for item in node:
                yield from pages(item)
        elif isinstance(node, dict):
            for value in node.values():
                yield from pages(value)

    listed = set(pages(nav))
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk - listed == set(), "pages missing from mkdocs.yml's nav"
    assert listed - on_disk == set(), "nav entries without a page"


mkdocs_missing = pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                                    reason="mkdocs is not installed (pip install -e '.[docs]'; scripts/test.sh does)")


def _mkdocs_build(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.mark.slow
@mkdocs_missing
def test_the_site_builds_strictly(tmp_path):
    built = _mkdocs_build(ROOT, tmp_path / "site")
    assert built.returncode == 0, built.stdout + built.stderr
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "make_config" in api and "Greedy accuracy" in api  # mkdocstrings rendered the docstrings


BROKEN_LINKS = ["[gone](no-such-page.md)", "[gone](benchmarks.md#no-such-anchor)"]


@pytest.fixture(scope="module")
def build_with_broken_links(tmp_path_factory) -> subprocess.CompletedProcess:
    """One strict build of a copy of the site whose index has every BROKEN_LINKS entry: mkdocs reports each broken
    link on its own warning line before strict mode aborts, so one build serves every case."""
    copy = tmp_path_factory.mktemp("broken") / "repo"
    for name in ("mkdocs.yml", "CHANGELOG.md"):
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, copy / name)
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copytree(ROOT / "src", copy / "src", ignore=shutil.ignore_patterns("__pycache__"))
    index = copy / "docs" / "index.md"
    index.write_text(index.read_text() + "".join(f"\n{broken}\n" for broken in BROKEN_LINKS))
    return _mkdocs_build(copy, copy.parent / "site")


@pytest.mark.slow
@mkdocs_missing
@pytest.mark.parametrize("broken", BROKEN_LINKS)
def test_a_broken_link_fails_the_build(build_with_broken_links, broken):
    built = build_with_broken_links
    assert built.returncode != 0
    target = broken[broken.index("(") + 1:-1]
    warned = [line for line in (built.stdout + built.stderr).splitlines()
              if line.startswith("WARNING") and "'index.md'" in line and f"'{target}'" in line]
    assert len(warned) == 1, built.stdout + built.stderr


def _slug(heading: str) -> str:
    """Python-Markdown's (and GitHub's, for these headings) anchor of a heading."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_readme_links_point_at_existing_pages_and_headings():
    """README.md is not part of the site, so mkdocs does not check its links: this does."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert links
    for link in links:
        if "://" in link:
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), link
        if anchor:
            headings = re.findall(r"^#+\s+(.*)$", target.read_text(), re.MULTILINE)
            assert anchor in {_slug(h) for h in headings}, link
