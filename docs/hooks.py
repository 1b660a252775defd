"""Build hooks for the docs site (mkdocs.yml names this file twice: as MkDocs hooks and as a griffe
extension for mkdocstrings). Nothing here is part of the qkmla package.

* The README is the site's home page: it is added as ``index.md``, its links into ``docs/``
  made relative to the site.
* A page may link to any file of the repository by its relative path (a results file, a
  figure, a benchmark script), so the Markdown reads the same on GitHub and on the site: such
  files are copied into the site under ``repo/`` and the links rewritten to point there. A
  link to a repository path that does not exist fails the build, as a broken link between
  pages does in strict mode; a link to a directory goes to its README.md.
* Docstrings are written for reST-aware readers (``literal``, :func:`name`) and give shapes in
  brackets (``rows [..., width] as [c ; k^R] [..., d_c + d_r]``): the griffe extension turns the
  roles into code spans and escapes a bracket that follows another, which Markdown would
  read as a reference link.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

import griffe
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

# [text](target) and ![alt](target): a relative target without a scheme, an optional #anchor.
LINK = re.compile(r"(!?\[[^\]]*\]\()(?![a-z][a-z0-9+.-]*:|#|/)([^)\s#]+)(#[^)\s]*)?\)")
# Fenced blocks, indented lines and code spans: a link there is not a link.
CODE = re.compile(r"^```.*?^```|^    .*?$|`[^`\n]*`", re.S | re.M)
ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|data|mod|obj|exc):`~?([^`]+)`")
SPAN = re.compile(r"(``.*?``|`[^`]*`|^    .*?$)", re.S | re.M)  # code in a docstring: left as it is


def _root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def _source_dir(page_src_uri: str, config) -> Path:
    """The directory a page's relative links start from: the repository root for the README,
    the file's own directory for a repository page copied under repo/."""
    if page_src_uri == "index.md":
        return _root(config)
    if page_src_uri.startswith("repo/"):
        return _root(config) / posixpath.dirname(page_src_uri.removeprefix("repo/"))
    return Path(config.docs_dir).resolve() / posixpath.dirname(page_src_uri)


def _links(markdown: str):
    """Every relative link outside code blocks: (match, target, anchor)."""
    prose = CODE.sub(lambda m: " " * len(m.group(0)), markdown)
    for m in LINK.finditer(prose):
        yield m, m.group(2), m.group(3) or ""


def _resolve(target: str, start: Path, config) -> tuple[str, Path]:
    """("docs", path under docs_dir) or ("repo", path under the repository root) for a link target."""
    root, docs = _root(config), Path(config.docs_dir).resolve()
    path = (start / target).resolve()
    if path.is_dir() and (path / "README.md").is_file():
        path = path / "README.md"
    if path.is_relative_to(docs):
        return "docs", path
    if not path.is_relative_to(root) or not path.is_file():
        raise PluginError(f"a link to {target!r} (from {start}) names no file of the repository")
    return "repo", path


def on_files(files, config):
    root = _root(config)
    readme = (root / "README.md").read_text()
    files.append(File.generated(config, "index.md", content=readme))
    todo = [(f.src_uri, Path(f.abs_src_path).read_text()) for f in files.documentation_pages() if f.abs_src_path]
    todo.append(("index.md", readme))
    while todo:  # a repository page copied here may link to further files
        src_uri, markdown = todo.pop()
        for _, target, _ in _links(markdown):
            where, path = _resolve(target, _source_dir(src_uri, config), config)
            uri = "repo/" + path.relative_to(root).as_posix()
            if where == "repo" and files.get_file_from_path(uri) is None:
                files.append(File.generated(config, uri, abs_src_path=str(path)))
                if uri.endswith(".md"):
                    todo.append((uri, path.read_text()))
    return files


def on_page_markdown(markdown, page, config, files):
    root, docs = _root(config), Path(config.docs_dir).resolve()
    start = _source_dir(page.file.src_uri, config)
    here = posixpath.dirname(page.file.src_uri)
    out, last = [], 0
    for m, target, anchor in _links(markdown):
        where, path = _resolve(target, start, config)
        uri = path.relative_to(docs).as_posix() if where == "docs" else "repo/" + path.relative_to(root).as_posix()
        out += [markdown[last:m.start()], m.group(1), posixpath.relpath(uri, here or "."), anchor, ")"]
        last = m.end()
    return "".join(out) + markdown[last:]


def docstring_markdown(text: str) -> str:
    """:func:`name` becomes ``name``, and ``] [`` outside code becomes ``] \\[``."""
    parts = SPAN.split(ROLE.sub(r"``\1``", text))
    return "".join(p if i % 2 else re.sub(r"\](\s*)\[", r"]\1\\[", p) for i, p in enumerate(parts))


class SphinxRoles(griffe.Extension):
    """Docstrings as Markdown reads them (``docstring_markdown``)."""

    def on_instance(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = docstring_markdown(obj.docstring.value)
