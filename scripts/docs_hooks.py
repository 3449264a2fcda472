"""MkDocs hooks for the documentation site (mkdocs.yml): the pages that live outside docs/ - README.md as the
home page, BENCHMARKS.md, CHANGELOG.md and the normative spec - are added to the site as they are, and every
relative link of every page, written for reading the repository (on GitHub or in an editor), is mapped to the
same document's place in the site.  A link to a file the site does not publish (source code, tests, a result
file outside docs/) becomes the file's path as code, so that a strict build fails only on links that are
really broken."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
#: repository path -> path in the site
OUTSIDE = {"README.md": "index.md", "BENCHMARKS.md": "benchmarks.md", "CHANGELOG.md": "changelog.md",
           "spec/kvz.md": "spec/kvz.md", "spec/store.md": "spec/store.md", "spec/registry.md": "spec/registry.md"}
_SOURCE = {site: repo for repo, site in OUTSIDE.items()}
_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")


def on_files(files, config):
    for repo, site in OUTSIDE.items():
        files.append(File.generated(config, site, abs_src_path=str(ROOT / repo)))
    return files


def _site_path(repo: str) -> str | None:
    if repo in OUTSIDE:
        return OUTSIDE[repo]
    if repo.startswith("docs/"):
        return repo[len("docs/"):]
    return None


def on_page_markdown(markdown, page, config, files):
    src = page.file.src_uri
    repo_page = _SOURCE.get(src, "docs/" + src)
    here = posixpath.dirname(src)

    def fix(m):
        bang, text, target = m.groups()
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return m.group(0)  # a URL, an anchor on this page, or site-absolute
        path, _, anchor = target.partition("#")
        repo = posixpath.normpath(posixpath.join(posixpath.dirname(repo_page), path))
        site = _site_path(repo)
        if site is not None and site.endswith("/"):
            site = None
        if site is None or files.get_file_from_path(site) is None:
            if site is None and (ROOT / repo).is_dir() and (ROOT / repo / "kvz.md").exists():
                site = _site_path(repo + "/kvz.md")
            else:  # not published in the site: name the file
                return f"{text} (`{repo}`)" if not bang and text and text != repo else f"`{repo}`"
        rel = posixpath.relpath(site, here or ".")
        return f"{bang}[{text}]({rel}{'#' + anchor if anchor else ''})"

    out, fenced = [], False
    for line in markdown.split("\n"):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
        out.append(line if fenced else _LINK.sub(fix, line))
    return "\n".join(out)


_ROLE = re.compile(r":(?:class|func|meth|attr|mod|exc|data):<code>(~?)([\w.]+)</code>")


def on_page_content(html, page, config, files):
    """Docstrings name other objects with Sphinx roles (:class:`~kvcodec.KVCache`); in the site they read as
    code: the short name after ``~``, else the full one."""
    return _ROLE.sub(lambda m: f"<code>{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}</code>", html)
