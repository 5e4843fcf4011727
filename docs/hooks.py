"""MkDocs hook (mkdocs.yml `hooks:`): the site keeps the repository's layout.

MkDocs only reads `docs_dir`, which may not be the repository root. This hook moves every page of
docs/ to `docs/<page>` and adds the Markdown outside docs/ that belongs on the site (README.md as
the home page, the recipes' READMEs) and the files those pages link to, each under its path in
the repository. A relative link then names the same file on the site as in the repository, so
the Markdown reads the same on its own and on the site, and strict mode checks every link.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

# Repository files outside docs/ that are on the site, as glob patterns from the root.
OUTSIDE_DOCS = ("README.md", "recipes/*/README.md", "conf/**/*.yaml")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    root = Path(config.config_file_path).parent
    docs_dir = Path(config.docs_dir)
    kept = []
    for file in files:
        if file.src_dir is not None and Path(file.src_dir) == docs_dir:
            prefix = docs_dir.relative_to(root).as_posix()
            file = _file(f"{prefix}/{file.src_uri}", root, config, file.inclusion)
        kept.append(file)
    for pattern in OUTSIDE_DOCS:
        kept += [_file(p.relative_to(root).as_posix(), root, config) for p in root.glob(pattern)]
    return Files(kept)


def _file(src_uri: str, root: Path, config: MkDocsConfig, inclusion=None) -> File:
    file = File(src_uri, str(root), config.site_dir, config.use_directory_urls)
    if inclusion is not None:
        file.inclusion = inclusion
    return file
