"""Build the bundled example folder of `make demo-domain`: dataset/demo/documents/ and its reference texts.

    python scripts/build_documents_demo.py [--out_dir dataset/demo]

The text is known: the documentation of a fixed list of Python standard-library modules, as their docstrings
(PSF License 2.0; dataset/demo/NOTICE.md). Each module becomes one document of headings, paragraphs and code
blocks, rendered into one format with that format's own library, with the boilerplate a real file of the kind
carries around the text:

  - PDF (fpdf2; DejaVu fonts embedded): a running header, a footer with the page number, several pages;
  - HTML (lxml): a site header with navigation, a sidebar of links and a footer around the <article>;
  - EPUB (ebooklib): one book, a chapter per module, with its navigation document;
  - DOCX (python-docx): headings, paragraphs, code in a monospace font, a page header and footer;
  - Markdown and plain text, and one JSONL file of {"text"} records.

documents_reference.jsonl holds each file's exact text ({"file", "text"}; a file of several documents, the
EPUB and the JSONL, has their texts joined by blank lines; a Markdown file, read as it is, is its own), which
bench/bench_ingest.py measures extraction against: how much of it comes back, and how much that comes back is
not in it (the boilerplate).

The docstrings are those of the Python that runs this script (the version is recorded in the reference file's
first record); the files are written deterministically (fixed dates, zip entries in a fixed order and time), so
the same Python gives the same bytes.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import io
import json
import re
import sys
import zipfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

# One document per module. Chosen for prose (not only signatures) and spread over the library's areas.
MODULES = """
    argparse bisect calendar collections contextlib csv dataclasses datetime decimal difflib enum fractions
    functools gzip hashlib heapq html http.client itertools json logging os.path pathlib pickle queue random re
    shutil sqlite3 statistics string subprocess tarfile textwrap threading timeit typing urllib.parse uuid zipfile
    abc base64 codecs configparser copy fnmatch getopt glob graphlib ipaddress locale mimetypes numbers operator
    pprint secrets shlex socketserver tempfile tokenize traceback warnings weakref
""".split()

# Which modules go into which format (in MODULES' order): PDF files bundle several modules, the EPUB is one
# book of several chapters, the JSONL one file of several records; the others are a file per module.
LAYOUT = [("pdf", 3), ("pdf", 4), ("pdf", 3)] + [("html", 1)] * 12 + [("epub", 9)] + [("docx", 1)] * 8 \
    + [("md", 1)] * 10 + [("txt", 1)] * 8 + [("jsonl", 6)]

FIXED_DATE = datetime(2026, 1, 1, tzinfo=timezone.utc)
FONT_DIR = Path("/usr/share/fonts/truetype/dejavu")
SITE = "Python Library Notes"


@dataclass
class Block:
    kind: str  # "h1", "h2", "p" or "code"
    text: str


# ------------------------------------------------------------------------------------------------ the text
def _doc_blocks(doc: str) -> list[Block]:
    """A docstring as paragraphs (lines re-flowed) and code blocks (doctest or indented lines, kept as lines)."""
    blocks = []
    for chunk in re.split(r"\n\s*\n", inspect.cleandoc(doc)):
        lines = [line.rstrip() for line in chunk.splitlines() if line.strip()]
        if not lines:
            continue
        if any(line.startswith(">>>") for line in lines) or all(line.startswith(" ") for line in lines):
            blocks.append(Block("code", "\n".join(lines)))
        else:
            blocks.append(Block("p", " ".join(line.strip() for line in lines)))
    return blocks


def _usable(doc: str | None) -> bool:
    # an object's repr in a signature or docstring ("<object at 0x7f...>") differs between runs
    return bool(doc and doc.strip()) and "0x" not in doc


def _signature(obj: object) -> str:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    return "" if "0x" in sig or len(sig) > 120 else sig


def module_document(name: str) -> list[Block]:
    """The module's docstring, then each public class and function defined in it (sorted by name) with its own
    docstring, and a class's public methods after it. Objects without a docstring of their own are left out."""
    mod = importlib.import_module(name)
    blocks = [Block("h1", f"The {name} module")]
    if _usable(mod.__doc__):
        blocks += _doc_blocks(mod.__doc__)
    for attr, obj in sorted(vars(mod).items()):
        if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__ or not _usable(obj.__doc__):
            continue
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        title = f"class {attr}" if inspect.isclass(obj) else f"{attr}{_signature(obj)}"
        blocks += [Block("h2", title), *_doc_blocks(obj.__doc__)]
        if inspect.isclass(obj):
            for meth, fn in sorted(vars(obj).items()):
                if not meth.startswith("_") and inspect.isfunction(fn) and _usable(fn.__doc__):
                    blocks += [Block("h2", f"{attr}.{meth}{_signature(fn)}"), *_doc_blocks(fn.__doc__)]
    return blocks


def plain_text(blocks: list[Block]) -> str:
    return "\n\n".join(b.text for b in blocks)


# ------------------------------------------------------------------------------------------------ renderers
def _fixed_zip(data: bytes) -> bytes:
    """The same archive with every entry dated FIXED_DATE, in the original order (mimetype first for EPUB),
    so that a rebuild gives the same bytes."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            fixed = zipfile.ZipInfo(info.filename, date_time=FIXED_DATE.timetuple()[:6])
            fixed.compress_type = info.compress_type
            fixed.external_attr = 0o644 << 16
            dst.writestr(fixed, src.read(info.filename))
    return out.getvalue()


def render_pdf(docs: list[list[Block]], title: str) -> bytes:
    from fpdf import FPDF

    class Pdf(FPDF):
        def header(self) -> None:  # the running header: boilerplate the extraction should drop
            self.set_font("sans", size=8)
            self.cell(0, 6, f"{SITE} · {title}", align="R")
            self.ln(10)

        def footer(self) -> None:
            self.set_y(-15)
            self.set_font("sans", size=8)
            self.cell(0, 10, f"{self.page_no()}", align="C")

    pdf = Pdf(format="A4")
    pdf.set_creation_date(FIXED_DATE)
    pdf.add_font("sans", fname=str(FONT_DIR / "DejaVuSans.ttf"))
    pdf.add_font("sans", style="B", fname=str(FONT_DIR / "DejaVuSans-Bold.ttf"))
    pdf.add_font("mono", fname=str(FONT_DIR / "DejaVuSansMono.ttf"))
    pdf.set_auto_page_break(True, margin=20)
    for blocks in docs:
        pdf.add_page()
        for b in blocks:
            if b.kind == "code":
                pdf.set_font("mono", size=8)
                pdf.multi_cell(0, 4, b.text, new_x="LMARGIN", new_y="NEXT")
            else:
                pdf.set_font("sans", style="B" if b.kind in ("h1", "h2") else "",
                             size={"h1": 15, "h2": 11}.get(b.kind, 10))
                pdf.multi_cell(0, 5 if b.kind == "p" else 7, b.text, new_x="LMARGIN", new_y="NEXT")
            pdf.ln(2)
    return bytes(pdf.output())


def _html_body(blocks: list[Block]) -> list:
    from lxml.html import builder as E

    tags = {"h1": E.H1, "h2": E.H2, "p": E.P}
    return [E.PRE(E.CODE(b.text)) if b.kind == "code" else tags[b.kind](b.text) for b in blocks]


def render_html(blocks: list[Block], name: str, others: list[str]) -> bytes:
    import lxml.html
    from lxml.html import builder as E

    page = E.HTML(
        E.HEAD(E.META(charset="utf-8"), E.TITLE(f"{name} · {SITE}")),
        E.BODY(
            E.DIV(E.CLASS("site-header"),
                  E.NAV(*[E.A(label, href=href) for label, href in
                          [("Home", "index.html"), ("Library", "library.html"), ("Modules", "modules.html"),
                           ("Search", "search.html"), ("Sign in", "login.html")]])),
            E.DIV(E.CLASS("sidebar"),
                  E.H3("Other modules"), E.UL(*[E.LI(E.A(o, href=f"{o}.html")) for o in others]),
                  E.P("Subscribe to our newsletter for weekly tips.")),
            E.E.main(E.E.article(*_html_body(blocks))),
            E.E.footer(E.P(f"© 2026 {SITE}. All rights reserved."),
                       E.P(E.A("Privacy", href="privacy.html"), " · ", E.A("Terms", href="terms.html"), " · ",
                           E.A("Contact", href="contact.html"))),
        ),
    )
    return lxml.html.tostring(page, doctype="<!DOCTYPE html>", encoding="utf-8", pretty_print=True)


def render_epub(docs: list[list[Block]], names: list[str]) -> bytes:
    import lxml.html
    from ebooklib import epub

    book = epub.EpubBook()
    book.set_identifier("pocketlm-demo-python-library-notes")
    book.set_title(f"{SITE}: selected modules")
    book.set_language("en")
    book.add_author("Python documentation authors")
    chapters = []
    for i, (blocks, name) in enumerate(zip(docs, names)):
        chapter = epub.EpubHtml(title=name, file_name=f"chap_{i:02d}.xhtml", lang="en")
        chapter.content = b"".join(lxml.html.tostring(el, encoding="utf-8") for el in _html_body(blocks))
        book.add_item(chapter)
        chapters.append(chapter)
    book.toc = chapters
    book.add_item(epub.EpubNcx())
    book.add_item(epub.EpubNav())
    book.spine = ["nav", *chapters]
    buf = io.BytesIO()
    epub.write_epub(buf, book, {"mtime": FIXED_DATE})
    return _fixed_zip(buf.getvalue())


def render_docx(blocks: list[Block], name: str) -> bytes:
    import docx
    from docx.shared import Pt

    doc = docx.Document()
    props = doc.core_properties
    props.created = props.modified = FIXED_DATE.replace(tzinfo=None)
    props.author, props.title = "Python documentation authors", name
    section = doc.sections[0]
    section.header.paragraphs[0].text = f"{SITE} · {name}"
    section.footer.paragraphs[0].text = "Draft for internal review"
    for b in blocks:
        if b.kind in ("h1", "h2"):
            doc.add_heading(b.text, level=1 if b.kind == "h1" else 2)
        elif b.kind == "code":
            run = doc.add_paragraph().add_run(b.text)
            run.font.name, run.font.size = "DejaVu Sans Mono", Pt(9)
        else:
            doc.add_paragraph(b.text)
    buf = io.BytesIO()
    doc.save(buf)
    return _fixed_zip(buf.getvalue())


def render_markdown(blocks: list[Block]) -> str:
    marks = {"h1": "# ", "h2": "## ", "p": ""}
    return "\n\n".join(f"```python\n{b.text}\n```" if b.kind == "code" else marks[b.kind] + b.text
                       for b in blocks) + "\n"


# ------------------------------------------------------------------------------------------------ the folder
def build(out_dir: Path) -> list[dict[str, str]]:
    """Write out_dir/documents/ and out_dir/documents_reference.jsonl; return the reference records."""
    folder = out_dir / "documents"
    if sum(n for _, n in LAYOUT) != len(MODULES):
        raise SystemExit(f"LAYOUT places {sum(n for _, n in LAYOUT)} modules, MODULES has {len(MODULES)}")
    docs = {name: module_document(name) for name in MODULES}
    files: dict[str, bytes] = {}
    refs: dict[str, str] = {}
    at = 0
    for fmt, n in LAYOUT:
        names, at = MODULES[at:at + n], at + n
        blocks = [docs[m] for m in names]
        stem = names[0].replace(".", "_") if n == 1 else f"{fmt}-{names[0].replace('.', '_')}-and-{n - 1}-more"
        path = {"pdf": f"pdf/{stem}.pdf", "html": f"site/{stem}.html", "epub": "books/library-notes.epub",
                "docx": f"office/{stem}.docx", "md": f"notes/{stem}.md", "txt": f"notes/{stem}.txt",
                "jsonl": f"{stem}.jsonl"}[fmt]
        if fmt == "pdf":
            files[path] = render_pdf(blocks, ", ".join(names))
        elif fmt == "html":
            files[path] = render_html(blocks[0], names[0], [m for m in MODULES[:12] if m != names[0]])
        elif fmt == "epub":
            files[path] = render_epub(blocks, names)
        elif fmt == "docx":
            files[path] = render_docx(blocks[0], names[0])
        elif fmt == "md":
            files[path] = render_markdown(blocks[0]).encode("utf-8")
        elif fmt == "txt":
            files[path] = (plain_text(blocks[0]) + "\n").encode("utf-8")
        else:
            files[path] = "".join(json.dumps({"text": plain_text(b)}, ensure_ascii=False) + "\n"
                                  for b in blocks).encode("utf-8")
        # a Markdown file is read as it is (its markup is part of the text a model learns), so it is its own
        # reference; every other format's is the plain text its markup or layout was rendered from
        refs[path] = files[path].decode("utf-8").strip() if fmt == "md" else "\n\n".join(map(plain_text, blocks))
    for path, data in files.items():
        target = folder / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    records = [{"file": path, "text": text} for path, text in sorted(refs.items())]
    header = {"python": sys.version.split()[0], "modules": MODULES,
              "note": "reference texts of dataset/demo/documents/ (scripts/build_documents_demo.py)"}
    with open(out_dir / "documents_reference.jsonl", "w", encoding="utf-8") as f:
        for r in [header, *records]:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="dataset/demo", help="where documents/ and its reference file go")
    args = p.parse_args(argv)
    records = build(Path(args.out_dir))
    chars = sum(len(r["text"]) for r in records)
    print(f"wrote {len(records)} files ({chars:,} characters of reference text) to {args.out_dir}/documents")
    return 0


if __name__ == "__main__":
    sys.exit(main())
