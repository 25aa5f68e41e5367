"""mkdocs hooks: pages that live beside the code they describe, copied in at build time, so they cannot drift.

- ``plugins.md``, ``kernel-conventions.md``: copied from ``core/docs/``;
- ``configuration.md``: ``core/docs/configuration.md``, followed by a table of every key of
  ``kernels_core/_config.py`` (read with ``ast``, nothing imported) and every environment variable (``ENV_*``
  constants of ``_config.py`` and ``_plugins/_loading.py``); a key or variable without a description fails the build;
- ``benchmarks.md`` and ``assets/*.svg`` are files written by ``python -m tools.report --write``; the build runs
  ``python -m tools.report --check`` and fails when they (or the README's results table) no longer match
  ``benchmarks/results/``.

Links from any page to repository files outside the site become the file's path in code (the site has no copy of
it); links to a file the site includes point at its page.
"""

from __future__ import annotations

import ast
import logging
import posixpath
import re
import subprocess
import sys
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page


ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("mkdocs.hooks.kernels_core")

# Site page -> the repository file it is copied from (links are rewritten relative to that file's folder).
SOURCES = {
    "plugins.md": "core/docs/plugins.md",
    "kernel-conventions.md": "core/docs/kernel-conventions.md",
    "configuration.md": "core/docs/configuration.md",
}
PAGE_OF = {source: page for page, source in SOURCES.items()}

# Configuration keys by table; every key in _config.py's key sets needs an entry here.
CONFIG_KEYS = {
    "_TOP_KEYS": ("top level", {
        "disable": "`true` makes kernelize a reported no-op.",
        "strict": "`true`: every matched module a kernel could serve gets one, or kernelize raises (names in the "
                  "configuration still only warn).",
        "plugins": "table: `allow` / `block` lists of plugin names.",
        "kernels": "table: `disable`, kernel ids never to use.",
        "kinds": "one table per layer kind (`[kinds.rms_norm]`), keys below.",
    }),
    "_PLUGIN_KEYS": ("`[plugins]`", {
        "allow": "only these plugins are used (names as `kernels-core plugins` lists them).",
        "block": "these plugins are never used.",
    }),
    "_KERNEL_KEYS": ("`[kernels]`", {
        "disable": "kernel ids never to use, for every kind.",
    }),
    "_KIND_KEYS": ("`[kinds.<kind>]`", {
        "prefer": "kernel ids per backend, in order (`any` for every backend without its own entry); explicit: "
                  "an id that cannot be used where a module runs raises.",
        "disable": "kernel ids or plugin names never to use for this kind.",
        "strict": "raise when a module of this kind ends up without a kernel.",
        "enabled": "`false` leaves every module of this kind alone.",
        "options": "kind-specific options passed to the adapter (`materialize_logits` for the loss).",
    }),
}
ENV_VARS = {
    "KERNELS_CORE_CONFIG": "path of a TOML configuration file (above the working directory's files).",
    "KERNELS_CORE_DISABLE": "`1` makes kernelize a reported no-op.",
    "KERNELS_CORE_STRICT_CONFIG": "refused with `ConfigError` when set: names that match nothing always warn; a "
                                  "warnings filter on `kernels_core.ConfigWarning` makes them errors.",
    "KERNELS_CORE_PLUGINS": "comma-separated plugin names: only these are loaded.",
    "KERNELS_CORE_DISABLE_PLUGINS": "comma-separated plugin names never loaded.",
    "KERNELS_CORE_STRICT_PLUGINS": "`1` makes a broken plugin raise instead of being skipped with a warning.",
    "KERNELS_CORE_TRACE_PLUGINS": "`1` logs pluggy hook calls.",
}


def _key_tables() -> str:
    """Every configuration key and environment variable, from the source, each with its description."""
    tree = ast.parse((ROOT / "core/src/kernels_core/_config.py").read_text())
    manager = ast.parse((ROOT / "core/src/kernels_core/_plugins/_loading.py").read_text())
    sets: dict[str, list[str]] = {}
    env: list[str] = []
    for node in [*tree.body, *manager.body]:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
            if name in CONFIG_KEYS and isinstance(value, ast.Call) and value.args:
                sets[name] = sorted(ast.literal_eval(value.args[0]))
            elif name.startswith("ENV_") and isinstance(value, ast.Constant):
                env.append(value.value)
    parts = ["## Every key", "", "Generated from `kernels_core/_config.py` at build time.", ""]
    for set_name, (where, described) in CONFIG_KEYS.items():
        keys = sets.get(set_name)
        if keys is None:
            log.warning("configuration page: %s not found in kernels_core/_config.py", set_name)
            continue
        parts += [f"### {where}", "", "| key | meaning |", "|---|---|"]
        for key in keys:
            if key not in described:
                log.warning("configuration page: key %r of %s has no description in docs/_hooks.py", key, set_name)
            parts.append(f"| `{key}` | {described.get(key, '')} |")
        parts.append("")
    for name in sorted(set(env)):
        if name not in ENV_VARS:
            log.warning("configuration page: %s has no description in docs/_hooks.py", name)
    return "\n".join(parts)


def _check_report() -> None:
    """``python -m tools.report --check`` from the repository root: one warning (an error under ``--strict``) naming
    every generated file that no longer matches ``benchmarks/results/``, or the check's own error."""
    done = subprocess.run([sys.executable, "-m", "tools.report", "--check"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        log.warning("python -m tools.report --check (exit %d):\n%s", done.returncode, done.stderr.strip()[-3000:])


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for page, source in SOURCES.items():
        text = (ROOT / source).read_text()
        if page == "configuration.md":
            text = text.rstrip() + "\n\n" + _key_tables()
        files.append(File.generated(config, page, content=text))
    _check_report()
    return files


_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    source = SOURCES.get(page.file.src_uri, f"docs/{page.file.src_uri}")
    base = posixpath.dirname(source)

    def fix(match: re.Match) -> str:
        text, target = match.groups()
        if re.match(r"^[a-z]+:|^#|^/", target):
            return match.group(0)
        path, _, anchor = target.partition("#")
        repo_path = posixpath.normpath(posixpath.join(base, path))
        if repo_path in PAGE_OF:
            return f"[{text}]({PAGE_OF[repo_path]}{'#' + anchor if anchor else ''})"
        if repo_path.startswith("docs/"):
            return match.group(0) if source.startswith("docs/") else f"[{text}]({repo_path[5:]})"
        return text if f"`{repo_path}`" in text else f"{text} (`{repo_path}`)"

    return _LINK.sub(fix, markdown)
