"""MkDocs hooks (mkdocs.yml, ``hooks:``): the generated parts of the pages rendered again (:mod:`generate`), and the
benchmark figures of ``benchmarks/results/`` served as ``figures/<name>.png`` (one copy of each, where the benchmarks
write it). The site's Markdown also gets each page's lists nested as GitHub nests them and its widest tables turned
to fit the content column, and its HTML a table's long code spans breakable only between their parts
(:func:`generate.site_lists`, :func:`generate.site_tables`, :func:`generate.site_table_code`). A page links a figure
by its path in the repository, ``../benchmarks/results/<name>.png``, which the repository's web view resolves; the
site's build rewrites it to ``figures/<name>.png``."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import generate  # noqa: E402


def on_files(files, config):
    from mkdocs.structure.files import File

    for png in sorted(generate.FIGURES.glob("*.png")):
        files.append(File.generated(config, f"figures/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown, page, config, files):
    return generate.site_tables(generate.site_lists(generate.site_figures(generate.render(markdown))))


def on_page_content(html, page, config, files):
    return generate.site_table_code(html)
