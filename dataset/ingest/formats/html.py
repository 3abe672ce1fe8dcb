"""HTML pages: the main text (trafilatura), headings and definition-list terms on lines of their own, without
navigation, sidebars, footers, comments or page chrome; a short page that marks its <main> is that element's text.
Also the block text of (X)HTML that EPUB chapters use."""
from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from typing import Any

from .base import Document, Extracted, Format, Reading, Unreadable, decode_text, library

# Page chrome, taken out before trafilatura sees the page: its rules catch most navigation, but not in the
# fallbacks it runs on a short page, which read the whole page again. Chrome here is what is never prose: what
# the page does not show (`hidden`, `aria-hidden`), widgets by their ARIA role (menus, toolbars, dialogs,
# search, navigation), <nav> and <button>, mdBook's menu bar (theme buttons, the book's title on every page) and
# its keyboard-help popup ("Press ← or → to navigate between chapters": hidden by the stylesheet, so nothing in
# the markup says so), texinfo's "Next: …, Up: …" line above and below each node (GNU manuals), and a heading's
# permalink ("¶" after Sphinx's headings, "§" before rustdoc's).
_CHROME = ("//*[@hidden or @aria-hidden='true' or @role='menu' or @role='menubar' or @role='toolbar'"
           " or @role='dialog' or @role='search' or @role='navigation'] | //nav | //button"
           " | //*[@id='mdbook-menu-bar' or @id='menu-bar' or @id='mdbook-help-container']"
           " | //div[@class='header' or @class='nav-panel'][p[starts-with(normalize-space(), 'Next:')"
           " or starts-with(normalize-space(), 'Previous:') or starts-with(normalize-space(), 'Up:')]]"
           " | //a[starts-with(@href, '#')][normalize-space()='¶' or normalize-space()='§' or normalize-space()='#']")
# The sections of Sphinx/docutils pages (<section>, or <div class="section"> before docutils 0.17), whose id is
# their heading's title
_TITLED_SECTIONS = "//section[@id] | //div[@id][contains(concat(' ', normalize-space(@class), ' '), ' section ')]"
_HEADINGS = frozenset({"h1", "h2", "h3", "h4", "h5", "h6"})
# characters: trafilatura's MIN_EXTRACTED_SIZE, under which it stops trusting the main text it found and falls
# back to reading the whole page, one line per piece of text ("your first\ncrate\n." around a link)
_SHORT_PAGE = 250


def _slug(text: str) -> str:
    """An id as docutils makes it from a title: ASCII letters and digits, the rest runs of "-"."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode().lower()
    return re.sub(r"[^a-z0-9]+", "-", ascii_text).strip("-")


def prepare_page(tree: Any) -> None:
    """Take a page's chrome out of its lxml tree (in place), and keep trafilatura from dropping sections for
    their titles."""
    for el in tree.xpath(_CHROME):
        el.drop_tree()  # its tail is text of the parent, kept
    # trafilatura drops a section whose id reads like navigation ("menu", "nav", "sidebar", "share"...), and a
    # docutils section's id is only its title (less its number, "24.6.1. Menus" -> "menus"): IDLE's help lost
    # "Menus" and "Editing and Navigation" whole
    for section in tree.xpath(_TITLED_SECTIONS):
        heading = next((c for c in section if c.tag in _HEADINGS), None)
        title, name = _slug(heading.text_content()) if heading is not None else "", _slug(section.get("id"))
        if name and (title == name or title.endswith("-" + name)):
            del section.attrib["id"]


def _frame_body(tree: Any) -> None:
    """Make <body> the frame of a page that has none of the frames trafilatura looks for main text in (<main>,
    <article>, class "content"...: DocBook and texinfo pages). Without one it gets only the page's loose
    paragraphs, not its headings nor its <dt> terms (a glossary of user names kept each definition, not the
    name); in a frame it reads the page the way it reads any other, its navigation and footers pruned the same
    way. BODY_XPATH is trafilatura's list of those frames (compiled XPaths; strings in older versions): without it
    the page is left as it is."""
    from trafilatura import xpaths

    frames = getattr(xpaths, "BODY_XPATH", None)
    body = tree.find("body")
    if frames is None or body is None or any(f(tree) if callable(f) else tree.xpath(f) for f in frames):
        return
    main = body.makeelement("main", {})
    main.text, body.text = body.text, None
    main.extend(list(body))
    body.append(main)


def _prose_size(el: Any) -> int:
    """Characters of text in an element outside its links, scripts and styles, runs of white space as one."""
    return len(" ".join(" ".join(el.xpath(".//text()[not(ancestor::a or ancestor::script or ancestor::style)]"))
                        .split()))


def _short_main(tree: Any) -> Any:
    """The main element of a short page that says where its main text is (one <main> or role="main", with at
    least half the page's text outside links: a one-paragraph mdBook chapter), or None. trafilatura does not
    trust so little text and falls back to reading the whole page; read block by block, the main element is the
    page's text."""
    landmarks, body = tree.xpath("//main | //*[@role='main']"), tree.find("body")
    if len(landmarks) != 1 or body is None:
        return None
    main = landmarks[0]
    short = 0 < main.xpath("string-length(normalize-space())") < _SHORT_PAGE
    return main if short and 2 * _prose_size(main) >= _prose_size(body) else None


def read_html(path: Path, reading: Reading) -> Extracted:
    trafilatura = library("trafilatura", "html")
    data = path.read_bytes()
    # trafilatura finds the page's charset itself; a given --encoding wins over it
    tree = trafilatura.load_html(decode_text(data, reading.encoding) if reading.encoding else data)
    if tree is None:
        raise Unreadable("not a readable HTML page")
    prepare_page(tree)
    main = _short_main(tree)
    if main is not None:
        text = block_text(main)
    else:
        _frame_body(tree)
        # trafilatura's text output HTML-unescapes text that the parser has already unescaped, so "&gt;"
        # written in a page (about HTML, say) would come out as ">": escaping every "&" first makes that
        # second pass give the text back as it is
        for el in tree.iter():
            if el.text and "&" in el.text:
                el.text = el.text.replace("&", "&amp;")
            if el.tail and "&" in el.tail:
                el.tail = el.tail.replace("&", "&amp;")
        text = trafilatura.extract(tree, include_comments=False, include_tables=True, deduplicate=False)
    if not text or not text.strip():
        raise Unreadable("no main text found in the page")
    return Extracted([Document(text, str(path))])


# The block elements of (X)HTML: their text goes on lines of its own.
_BLOCKS = frozenset("address article aside blockquote br dd div dl dt figcaption figure footer h1 h2 h3 h4 h5 h6 "
                    "header hr li main nav ol p pre section table td th tr ul".split())


# A <pre>'s own line breaks, held through the split into lines (a private-use character: no page's text has it)
_PRE_BREAK = "\ue000"


def block_text(root: Any) -> str:
    """All the text of an lxml (X)HTML element, one line per block element, <pre> kept as it is: its lines and
    their indentation (the element is changed: read it once)."""
    import lxml.etree

    for bad in list(root.iter("script", "style", "head")):  # listed first: a drop ends a walk inside it
        bad.drop_tree()
    for el in root.iter():
        tag = el.tag.rsplit("}", 1)[-1] if isinstance(el.tag, str) else ""
        if tag in _BLOCKS:
            el.tail = "\n" + (el.tail or "")
            if tag == "pre":  # on a line of its own ("Run<pre>make" once read "Runmake"), its own breaks marked
                el.text = "\n" + _PRE_BREAK + (el.text or "").replace("\n", _PRE_BREAK)
                for inner in el.iterdescendants():
                    inner.text, inner.tail = (t.replace("\n", _PRE_BREAK) if t else t for t in (inner.text, inner.tail))
            elif el.text:
                el.text = "\n" + el.text
    lines = (re.sub(r"[ \t]+", " ", line).strip() if _PRE_BREAK not in line
             else "\n".join(part.rstrip() for part in line.split(_PRE_BREAK)).strip("\n")
             for line in lxml.etree.tostring(root, method="text", encoding="unicode", with_tail=False).split("\n"))
    return "\n".join(line for line in lines if line.strip())


def html_block_text(markup: bytes) -> str:
    """All the text of an (X)HTML document (an EPUB chapter: no page furniture to remove), one line per block
    element, <pre> kept as it is."""
    import lxml.html

    return block_text(lxml.html.document_fromstring(markup))


HTML = Format("html", (".html", ".htm", ".xhtml"), read_html)
