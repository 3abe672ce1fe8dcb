"""Fetch modern Chinese text for training the default tokenizer: Debian's Simplified Chinese documentation.

    python scripts/fetch_zh_docs.py                       # -> dataset/zh_docs/zh_docs.jsonl (in the repository)
    python scripts/fetch_zh_docs.py --out_dir DIR         # -> DIR/zh_docs.jsonl

The benchmark corpus's Chinese is 94% classical poetry (chinese-poetry), with two small modern sources (the
Chinese Union Version Bible and the kernel documentation's zh_CN translation). A tokenizer trained on it learns
classical characters and misses the words of modern technical and conversational Chinese (docs/tokenizer.md).
This script adds modern technical Chinese from Debian's archive, reached through `apt-get download` (no
installation, no root needed after an `apt-get update`): Chinese manual pages, the Debian Reference, the Debian
Edu manual, and the KiCad, LilyPond and GIMP manuals' Chinese translations. HTML is reduced to its text and man
pages to theirs; of each document only the paragraphs that are mostly Chinese are kept (the translations leave
many sections in English). Output: one {"text", "source", "lang": "zh"} document per line, plus manifest.json
with each package's version and the sha256 of its .deb and of the JSONL.

Only statistics of this text (BPE merges) are shipped, inside model/tokenizer/; the text itself is not
committed. Its licenses (GPL and GFDL) are in each package's /usr/share/doc/<package>/copyright.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.files import file_sha256  # noqa: E402

PACKAGES = ("manpages-zh", "debian-reference-zh-cn", "debian-edu-doc-zh-cn", "kicad-doc-zh", "lilypond-doc-html-zh",
            "gimp-help-zh-cn")
MIN_CJK_SHARE = 0.3  # a paragraph is kept when at least this share of its characters are CJK ideographs
MIN_DOC_CHARS = 200
CJK = re.compile(r"[\u4e00-\u9fff]")
BLOCK_TAGS = {"p", "div", "br", "li", "h1", "h2", "h3", "h4", "h5", "tr", "pre", "dt", "dd", "table", "section"}


class _HTMLText(HTMLParser):
    """An HTML page's visible text, a paragraph break at each block element."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.hidden = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.hidden += tag in ("script", "style")
        if tag in BLOCK_TAGS:
            self.parts.append("\n\n")

    def handle_endtag(self, tag: str) -> None:
        self.hidden -= tag in ("script", "style")

    def handle_data(self, data: str) -> None:
        if not self.hidden:
            self.parts.append(data)


def html_text(raw: str) -> str:
    parser = _HTMLText()
    parser.feed(raw)
    return "".join(parser.parts)


def man_text(raw: str) -> str:
    """A roff man page's words: comments, requests and font escapes removed."""
    raw = re.sub(r"^\.\\\".*$", "", raw, flags=re.M)            # comments
    raw = re.sub(r"^\.(SH|SS)\s*", "\n\n", raw, flags=re.M)     # section headings start paragraphs
    raw = re.sub(r"^\.(PP|LP|P|TP|IP|HP|sp|br)\b.*$", "\n\n", raw, flags=re.M)
    raw = re.sub(r"^\.[A-Za-z]+\s?", "", raw, flags=re.M)      # any other request: keep its argument text
    return re.sub(r"\\f[BIRP1-4]|\\f\(..|\\-|\\\(..|\\&|\\e|\\\*\(..|\\\*.", "", raw)


def chinese_paragraphs(text: str) -> str:
    """The paragraphs of `text` that are mostly Chinese, whitespace inside each collapsed."""
    keep = []
    for para in re.split(r"\n\s*\n", text):
        para = re.sub(r"[ \t]+", " ", para).strip()
        para = re.sub(r"\n\s+", "\n", para)
        if para and len(CJK.findall(para)) >= MIN_CJK_SHARE * len(para):
            keep.append(para)
    return "\n\n".join(keep)


def documents(root: Path) -> list[tuple[str, str]]:
    """(source, text) for every page under an extracted package tree, in path order."""
    out = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = str(path.relative_to(root))
        if rel.startswith("usr/share/man/zh_CN/") and path.suffix == ".gz":
            text = man_text(gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace"))
        elif path.suffix == ".html":
            text = html_text(path.read_text(encoding="utf-8", errors="replace"))
        else:
            continue
        text = chinese_paragraphs(text)
        if len(text) >= MIN_DOC_CHARS:
            out.append((rel, text))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default=str(ROOT / "dataset" / "zh_docs"),
                   help="where zh_docs.jsonl and manifest.json go (default: dataset/zh_docs/ in the repository)")
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"packages": {}}
    with open(out / "zh_docs.jsonl", "w", encoding="utf-8") as f, tempfile.TemporaryDirectory() as tmp:
        for package in PACKAGES:
            debs = Path(tmp) / package
            debs.mkdir()
            try:
                subprocess.run(["apt-get", "download", package], cwd=debs, check=True, capture_output=True, text=True)
            except (OSError, subprocess.CalledProcessError) as e:
                detail = getattr(e, "stderr", "") or str(e)
                print(f"error: apt-get download {package} failed (run `apt-get update` first?): {detail.strip()}",
                      file=sys.stderr)
                return 2
            (deb,) = debs.glob("*.deb")
            tree = debs / "x"
            subprocess.run(["dpkg-deb", "-x", str(deb), str(tree)], check=True)
            docs = documents(tree)
            for rel, text in docs:
                f.write(json.dumps({"text": text, "source": f"{package}:{rel}", "lang": "zh"}, ensure_ascii=False)
                        + "\n")
            manifest["packages"][package] = {"deb": deb.name, "sha256": file_sha256(deb), "docs": len(docs),
                                             "chars": sum(len(t) for _, t in docs)}
            print(f"{package}: {len(docs)} documents, {manifest['packages'][package]['chars']:,} characters")
    manifest["jsonl_sha256"] = file_sha256(out / "zh_docs.jsonl")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"wrote {out / 'zh_docs.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
