"""Reading the final answer out of a solution's text (shared by the search loop and the toy trainer)."""

from __future__ import annotations

import re


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (balanced braces), or None."""
    found = None
    for match in re.finditer(r"\\boxed\s*\{", text):
        depth, i = 1, match.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found = text[match.end():i - 1]
    return found
