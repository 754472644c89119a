"""Every command the README and `rlanywhere --help` show runs from a fresh clone.

The commands are read at test time: from `rlanywhere --help`'s examples, and from the README's fenced shell blocks
(```bash, ```sh, ```shell). A block whose info string holds the word `template` (```bash template) shows a
command's shape with placeholders (`/models/<yours>`, `runs/x`) and is not run. In a copy of the repository's tracked
files (what a clone has: no data/, no runs/, no ../shared), in order:

* `prepare`, `plan`, `--help` and `--version` run as written; `train ARGS` runs as `plan ARGS` (for an 80 GB card
  unless ARGS say --emulate; a config for several GPUs is only loaded and checked) and `demo ARGS` plans the demo profile under ARGS (the same
  config and plan, no training); `eval`, `chat`, `plot`, `doctor` and torchrun lines are parsed;
* every file a command names must be in the clone, except what the commands make: runs/ and data/;
* `bash X` / `python X` name files that must exist; inline code in the README naming ../shared or shared/ fails.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from rlanywhere import cli

ROOT = Path(__file__).resolve().parents[1]
SHELL_BLOCK = re.compile(r"^```(bash|sh|shell)([^\n]*)\n(.*?)^```", re.S | re.M)
# made by the commands themselves (prepare, demo, train): a fresh clone does not have them yet
MADE_BY_COMMANDS = ("runs/", "data/")
FILE_SUFFIXES = (".yaml", ".yml", ".parquet", ".jsonl", ".json", ".args", ".py", ".sh", ".gguf", ".md")
REPO_FOLDERS = ("examples/", "tests/", "scripts/", "docs/", "bench/", "src/", ".ci/")


def _logical_lines(text: str) -> list[str]:
    """Shell lines with continuations joined and comments dropped."""
    joined = re.sub(r"\s*\\\n\s*", " ", text)
    lines = []
    for line in joined.splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        if not line or line.startswith("#"):
            continue
        lines.append(re.sub(r"\s+#\s.*$", "", line).rstrip(" &"))
    return lines


def readme_commands(readme: str) -> list[str]:
    commands = []
    for match in SHELL_BLOCK.finditer(readme):
        if "template" in match.group(2).split():
            continue
        commands += _logical_lines(match.group(3))
    return commands


def help_commands() -> list[str]:
    return _logical_lines("\n".join(line for line in (cli.__doc__ or "").splitlines()
                                    if line.strip().startswith("rlanywhere ")))


def _expand(line: str, clone: Path) -> list[str]:
    """The words of `line`, `$(cat FILE)` replaced by FILE's words (FILE must exist)."""
    def cat(match):
        file = clone / match.group(1)
        assert file.is_file(), f"{line!r}: {match.group(1)} is not in a fresh clone"
        return file.read_text()
    words = shlex.split(re.sub(r"\$\(cat ([^)]+)\)", cat, line))
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # VAR=value prefixes
        words = words[1:]
    return words


def _looks_like_file(word: str) -> bool:
    if "://" in word or word.startswith("-"):
        return False
    return (word.startswith(("./", "../", "/", "~")) or word.startswith(REPO_FOLDERS + ("shared/",))
            or word.endswith(FILE_SUFFIXES))


def _missing_files(words: list[str], clone: Path) -> list[str]:
    missing = []
    for word in words:
        value = word.split("=", 1)[1] if re.match(r"^[\w.+]+=", word) else word
        if not _looks_like_file(value) or value.startswith(MADE_BY_COMMANDS):
            continue
        if not (clone / value).exists():
            missing.append(value)
    return missing


def _rlanywhere_args(words: list[str]) -> list[str] | None:
    """The arguments after `rlanywhere` / `python -m rlanywhere.cli` / `torchrun ... -m rlanywhere.cli`."""
    if words[:1] == ["rlanywhere"]:
        return words[1:]
    for start in range(len(words) - 1):
        if words[start] == "-m" and words[start + 1] in ("rlanywhere.cli", "rlanywhere"):
            return words[start + 2:]
    return None


def run_documented(line: str, clone: Path) -> None:
    """Run (or parse) one documented command in `clone` as the module docstring says; fail with the line."""
    words = _expand(line, clone)
    if not words:
        return
    # files are checked as written: what a `$(cat FILE)` holds is the user's own (a verl command line's paths)
    literal = shlex.split(re.sub(r"\$\(cat ([^)]+)\)", r"\1", line))
    if words[0] in ("bash", "sh", "python", "python3") and len(words) > 1 and not words[1].startswith("-"):
        assert (clone / words[1]).is_file(), f"{line!r}: {words[1]} is not in a fresh clone"
        return
    args = _rlanywhere_args(words)
    if args is None:
        return  # pip, git, cd, ...: not ours to check
    args = [word for word in args if not word.startswith("[") and word != "..."]  # "[key=value ...]"
    missing = _missing_files([word for word in literal if not word.startswith("[")], clone)
    assert not missing, f"{line!r} names {missing}, which a fresh clone does not have"
    if "--help" in args or "--version" in args:
        with pytest.raises(SystemExit) as done:
            cli.main(args)
        assert done.value.code == 0, line
        return
    parsed = cli.build_parser().parse_args(args)  # argparse exits 2 on a bad command line
    if words[0] == "torchrun":
        return  # the launcher's part needs GPUs; its rlanywhere part parsed
    if parsed.command in ("prepare", "plan"):
        assert cli.main(args) == 0, line
    elif parsed.command == "train":
        # a bad key or value fails here; without --emulate the plan is made for a GPU the command is meant for (an
        # 80 GB card), not for whatever CPU runs the tests
        cfg, _ = cli._load(parsed.items, parsed.emulate or "a100-80g")
        if int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node) == 1:  # several GPUs: planned under torchrun
            assert cli.plan_main(cfg) == 0, f"{line!r} does not plan"
    elif parsed.command == "demo" and not parsed.resume:
        from rlanywhere.api import demo_config

        items = list(parsed.items) + ([f"hardware.emulate={parsed.emulate}"] if parsed.emulate else [])
        assert cli.plan_main(demo_config(items)) == 0, line


@pytest.fixture(autouse=True)
def _probe_once(monkeypatch):
    """One look at this machine for all the plans (the probe runs kernels; the machine does not change)."""
    import rlanywhere.machine as machine

    if not hasattr(_probe_once, "probe"):
        _probe_once.probe = machine.probe_machine()
    monkeypatch.setattr(machine, "probe_machine", lambda *args, **kwargs: _probe_once.probe)


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The tracked files of this checkout, as a fresh clone has them."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: cannot tell which files a clone has")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    out = tmp_path_factory.mktemp("clone")
    for name in filter(None, listed.decode().split("\0")):
        if (ROOT / name).is_file():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, out / name)
    return out


def test_extraction_reads_runnable_blocks_only():
    readme = ("```bash\nrlanywhere plan x.yaml   # a comment\nbash scripts/a.sh \\\n  --flag\n```\n"
              "```bash template\nrlanywhere train /models/<yours>\n```\n```text\nrlanywhere eval\n```\n")
    assert readme_commands(readme) == ["rlanywhere plan x.yaml", "bash scripts/a.sh --flag"]
    assert _missing_files(["a=../shared/x", "examples/none.yaml", "data/made.parquet", "Qwen/Qwen2.5"],
                          ROOT) == ["../shared/x", "examples/none.yaml"]


@pytest.mark.slow
def test_help_commands_run_in_a_fresh_clone(clone, monkeypatch, capsys):
    commands = help_commands()
    assert len(commands) >= 8 and any(c.startswith("rlanywhere plan") for c in commands)
    monkeypatch.chdir(clone)
    for line in commands:
        run_documented(line, clone)
    for name in ("demo", "train", "plan", "doctor", "eval", "chat", "prepare", "plot"):
        run_documented(f"rlanywhere {name} --help", clone)
    assert "../shared" not in capsys.readouterr().out


@pytest.mark.slow
def test_readme_commands_run_in_a_fresh_clone(clone, monkeypatch):
    readme = (clone / "README.md").read_text()
    commands = readme_commands(readme)
    assert any(c.startswith("rlanywhere ") for c in commands)
    monkeypatch.chdir(clone)
    for line in commands:
        run_documented(line, clone)
    # prose too: inline code naming the team's ../shared folder points at nothing in a clone
    stale = [span for span in re.findall(r"`([^`\n]+)`", readme) if span.startswith(("../shared", "shared/"))]
    assert not stale, f"README names {stale}: not in a fresh clone (tests/data holds the shipped copies)"
