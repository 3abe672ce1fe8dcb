"""Properties that must hold for any input, checked on inputs Hypothesis generates (and shrinks to the smallest
that fails): where the input space is too large for tests by example.

The default profile keeps each property to a few dozen examples so the suite stays fast;
`HYPOTHESIS_PROFILE=thorough` runs many more.
"""
from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from dataset.ingest import split_document

settings.register_profile("default", max_examples=60, deadline=None)
settings.register_profile("thorough", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# Text made of what decides where a document is cut: paragraph and line breaks, sentence ends (English and
# Chinese), spaces, and runs of letters too long for any boundary.
TEXT = st.lists(st.sampled_from(["A", "word", " ", "\n", "\n\n", ". ", "。", "中文", "x" * 37]), max_size=80).map("".join)


@given(text=TEXT, max_chars=st.integers(min_value=1, max_value=60))
def test_split_document_ends_keeps_the_text_in_order_and_keeps_to_max_chars(text, max_chars):
    """Every record is at most max_chars long (a run with no boundary is cut between characters), and the records
    are the text's own pieces in order, with nothing but whitespace between them: nothing lost, nothing repeated.
    (A long paragraph followed by more text once recursed until RecursionError.)"""
    records = split_document(text, max_chars)
    assert all(0 < len(r) <= max_chars for r in records)
    position = 0
    for record in records:
        found = text.find(record, position)
        assert found >= 0 and text[position:found].strip() == "", (record, text[position:found])
        position = found + len(record)
    assert text[position:].strip() == ""


def test_a_paragraph_longer_than_max_chars_then_more_text_is_split():
    """The two inputs that recursed forever at the default max_chars, by example."""
    for text in ("A" * 9000 + "\n\nnext", "word " * 2000 + "\n\nnext"):
        records = split_document(text, 8000)
        assert records[-1] == "next" and all(len(r) <= 8000 for r in records)
        assert "".join(records).replace(" ", "") == text.replace(" ", "").replace("\n", "")
