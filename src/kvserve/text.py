"""Checks of text that comes from users, shared by the offline API and the server."""
from __future__ import annotations


def valid_unicode(text: str) -> str:
    """text, if it can be encoded: no lone surrogate (which a JSON escape such as "\\ud800" makes); else
    ValueError saying where."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode (a lone surrogate at character {e.start})") from None
    return text
