"""The README and docs/ cannot drift from the code: every quoted command exists with the options it uses,
and every relative link lands on a file (and heading) that exists. Nothing here runs a command: the click
objects of kvrescue_local.cli are read."""

import re
import shlex
from pathlib import Path

import click
import pytest

from kvrescue_local.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND_START = re.compile(r"(?:kvrescue-local|python3 -m kvrescue_local)\s")
# where a quoted command line ends: a pipe, a list separator, a comment, a redirection, a subshell's end
SHELL_END = {"|", "||", "&&", ";", "&", "#", ")", ">", ">>", "2>&1"}
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_.]*$")  # `kvrescue-local COMMAND --help`


def _code_texts(markdown: str) -> list[str]:
    """Fenced blocks (backslash-continued lines joined) and inline code spans."""
    texts = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", markdown, flags=re.S):
        texts.extend(block.replace("\\\n", " ").splitlines())
    prose = re.sub(r"```[^\n]*\n.*?```", "", markdown, flags=re.S)
    texts.extend(span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose))
    return texts


def _split(command: str) -> list[str]:
    lexer = shlex.shlex(command, posix=True, punctuation_chars="|&;()<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:  # an unclosed quote: a command quoted inside a shell string, cut at its end
        tokens = shlex.split(command.split('"')[0])
    words = []
    for token in tokens:
        if token in SHELL_END:
            break
        words.append(token.strip("[]"))
    return words


def quoted_commands() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for text in _code_texts(doc.read_text()):
            for start in COMMAND_START.finditer(text):
                found.append((doc.relative_to(ROOT).as_posix(), text[start.end():].strip()))
    return found


def check_command(words: list[str]) -> list[str]:
    """What is wrong with `kvrescue-local WORDS`, read off the click objects; [] when nothing is."""
    command, path = main, ["kvrescue-local"]
    while isinstance(command, click.Group) and words and not words[0].startswith("-"):
        name = words.pop(0)
        if PLACEHOLDER.match(name):
            return []
        if name not in command.commands:
            return [f"`{' '.join(path)}` has no command `{name}` (it has: {', '.join(sorted(command.commands))})"]
        command, path = command.commands[name], [*path, name]
    accepted = {"--help"} | {opt for p in command.params if isinstance(p, click.Option) and not p.hidden
                             for opt in (*p.opts, *p.secondary_opts)}  # a hidden option is one refused
    problems = []
    for word in words:
        if word == "--":
            break
        if word.startswith("-") and not re.match(r"^-\d", word) and word != "-":
            option = word.split("=", 1)[0]
            if option not in accepted and not option.endswith("..."):
                problems.append(f"`{' '.join(path)}` has no option `{option}`")
    return problems


COMMANDS = quoted_commands()


def test_the_docs_quote_commands_at_all():
    assert len(COMMANDS) >= 30, COMMANDS
    assert {doc for doc, _ in COMMANDS} >= {"README.md", "docs/usage.md", "docs/results.md"}


@pytest.mark.parametrize("doc,command", COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in COMMANDS])
def test_every_quoted_command_and_option_exists(doc, command):
    problems = check_command(_split(command))
    assert not problems, f"{doc}: kvrescue-local {command}\n" + "\n".join(problems)


def test_the_checker_sees_a_wrong_command_and_a_wrong_option():
    assert check_command(_split("solve --budget 48 --no-such-option 1 x")) == [
        "`kvrescue-local solve` has no option `--no-such-option`"]
    assert check_command(_split("bench walk --limit 3"))[0].startswith("`kvrescue-local bench` has no command `walk`")
    assert check_command(_split("bench run --dataset toy --limit 3 | tail -1 --nonsense")) == []


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+\s+(.*)$", re.sub(r"```.*?```", "", markdown, flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def relative_links() -> list[tuple[Path, str]]:
    links = []
    for doc in DOCS:
        prose = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if not re.match(r"^[a-z]+:", target):
                links.append((doc, target))
    return links


def test_every_relative_link_resolves():
    links = relative_links()
    assert len(links) >= 20
    broken = []
    for doc, target in links:
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        if not path.exists():
            broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path.read_text()):
            broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
