"""Long documents into records of at most --max_chars characters, cut at the coarsest boundary that divides them:
paragraphs, lines, sentences, spaces, characters."""
from __future__ import annotations

from dataset.clean import sentence_pieces


def _pieces(text: str, max_chars: int) -> list[str]:
    """Cut points at the coarsest boundary that divides the text: paragraphs, lines, sentences, spaces, characters.
    Joined, the pieces give the text back, and each is shorter than the text, so splitting them again ends: a
    boundary only at the text's end (a long paragraph and its "\n\n") divides nothing and is passed over."""
    for sep in ("\n\n", "\n"):
        parts = text.split(sep)
        pieces = [p + sep for p in parts[:-1]] + [parts[-1]]
        if max(map(len, pieces)) < len(text):
            return pieces
    sentences = sentence_pieces(text)
    if len(sentences) > 1 and max(map(len, sentences)) < len(text):
        return sentences
    cut = text.rfind(" ", 0, max_chars)
    cut = cut if cut > 0 else max_chars
    return [text[:cut], text[cut:]]


def split_document(text: str, max_chars: int) -> list[str]:
    """A document as consecutive records of at most max_chars characters, cut at the coarsest boundary that
    keeps them under it (see _pieces); each record stripped of the whitespace at its ends."""
    if len(text.strip()) <= max_chars:  # whitespace at the ends (a paragraph's "\n\n") is no reason to cut
        return [text.strip()] if text.strip() else []
    chunks, current = [], ""
    for piece in _pieces(text, max_chars):
        if len(piece) > max_chars:
            if current.strip():
                chunks.append(current.strip())
            current = ""
            chunks += split_document(piece, max_chars)
        elif len(current) + len(piece) > max_chars:
            if current.strip():
                chunks.append(current.strip())
            current = piece
        else:
            current += piece
    if current.strip():
        chunks.append(current.strip())
    return chunks
