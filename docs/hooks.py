"""MkDocs hook: README.md (outside docs/) becomes the site's ``readme`` page.

README.md stays the one source for GitHub and PyPI. Its links into docs/
(``docs/keras.md``) are rewritten to site-relative ones, and the pages' links
back to ``../README.md`` point at the generated page, so ``--strict`` checks
every link of both.
"""

import os
import re

from mkdocs.structure.files import File

README = "readme.md"


def on_files(files, config):
    repo = os.path.dirname(config["config_file_path"])
    with open(os.path.join(repo, "README.md")) as f:
        text = f.read()
    text = re.sub(r"\]\(docs/", "](", text)
    files.append(File.generated(config, README, content=text))
    return files


def on_page_markdown(markdown, page, config, files):
    return re.sub(r"\]\(\.\./README\.md", f"]({README}", markdown)
