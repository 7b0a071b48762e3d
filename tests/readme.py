"""The README's shell commands, as a reader copies them: a section's `sh` blocks, each command
with its continuation lines joined and its comment dropped, split as the shell splits words."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"^```sh\n(.*?)^```$", re.M | re.S)


def section(title: str) -> str:
    """The text under the heading `title` (any level), up to the next heading of its level."""
    text = README.read_text(encoding="utf-8")
    heading = re.search(rf"^(#+) {re.escape(title)}\n", text, re.M)
    assert heading is not None, f"the README has no section {title!r}"
    level = len(heading[1])
    following = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, heading.end())
    return text[heading.end() : following.start() if following else len(text)]


def commands(title: str) -> list[list[str]]:
    """Each command of the section's `sh` blocks, as words."""
    found = []
    for block in _BLOCK.findall(section(title)):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                found.append(words)
    return found


def assignments(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """The variables a command sets for itself (`NAME=value` words before the program, or
    `export NAME=value`), and the rest of its words."""
    if words[:1] == ["export"]:
        words = words[1:]
    given: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
        name, _, value = words[0].partition("=")
        given[name] = value
        words = words[1:]
    return given, words
