"""Bounded messages: a value quoted in an error or a progress line is cut to a length a terminal can
show (a 300-million-character value once went into one)."""

from __future__ import annotations

from typing import Any

__all__ = ["capped", "cap_text"]


def capped(value: Any, limit: int = 200) -> str:
    """`repr(value)` (`str` for an exception), cut to about `limit` characters with the cut said."""
    text = str(value) if isinstance(value, BaseException) else repr(value)
    return cap_text(text, limit)


def cap_text(text: str, limit: int = 2000) -> str:
    """`text` cut to about `limit` characters, saying how many were cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"
