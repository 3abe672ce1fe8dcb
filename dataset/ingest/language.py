"""A record's language, as ISO 639-1 (py3langid), or "und" when it cannot be told."""
from __future__ import annotations

UNDETERMINED = "und"
_LANGUAGE_SAMPLE = 4000  # characters looked at to tell a record's language


def detect_language(text: str) -> str:
    """The ISO 639-1 code of the text's language (py3langid over its first characters), or "und" when there is
    too little text to tell or py3langid is not installed (`pip install py3langid`)."""
    sample = text[:_LANGUAGE_SAMPLE]
    if sum(map(str.isalpha, sample)) < 10:
        return UNDETERMINED
    try:
        import py3langid
    except ImportError:
        return UNDETERMINED
    return py3langid.classify(sample)[0]
