"""mkdocs hooks: pages generated at build time from the files they describe, so the site cannot drift from them.

- ``index.md``: README.md from its start to the end of "Command line" (getting started);
- ``verification.md``: README.md's "What was verified where" table;
- ``plugins.md``, ``kernel-conventions.md``: copied from ``core/docs/`` (their home beside the code);
- ``configuration.md``: the keys of ``kernels_core/_config.py`` (read with ``ast``, nothing imported) and the
  environment variables (``ENV_*`` constants of ``_config.py`` and ``_manager.py``), each with its description
  below; a key without one fails the build;
- ``benchmarks.md`` and its SVG charts: ``benchmarks/report.py`` over ``benchmarks/results/*.json``.

Links from these pages to repository files outside the site become the file's path in code (the site has no
copy of it); links to another included page point at that page.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import posixpath
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page


ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("mkdocs.hooks.kernels_core")

# Site page -> the repository file it comes from (for link rewriting, relative to that file's folder).
SOURCES = {
    "index.md": "README.md",
    "verification.md": "README.md",
    "plugins.md": "core/docs/plugins.md",
    "kernel-conventions.md": "core/docs/kernel-conventions.md",
    "configuration.md": "core/src/kernels_core/_config.py",
    "benchmarks.md": "benchmarks/report.py",
}
PAGE_OF = {"core/docs/plugins.md": "plugins.md", "core/docs/kernel-conventions.md": "kernel-conventions.md",
           "docs/integrations.md": "integrations.md"}

# Configuration keys by table; every key in _config.py's key sets needs an entry here.
CONFIG_KEYS = {
    "_TOP_KEYS": ("top level", {
        "disable": "`true` makes kernelize a reported no-op.",
        "strict": "`true` raises when a matched module gets no kernel.",
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
    "KERNELS_CORE_STRICT_CONFIG": "`1` makes a configuration problem that only warns raise `ConfigError` instead.",
    "KERNELS_CORE_PLUGINS": "comma-separated plugin names: only these are loaded.",
    "KERNELS_CORE_DISABLE_PLUGINS": "comma-separated plugin names never loaded.",
    "KERNELS_CORE_STRICT_PLUGINS": "`1` makes a broken plugin raise instead of being skipped with a warning.",
    "KERNELS_CORE_TRACE_PLUGINS": "`1` logs pluggy hook calls.",
}


def _section(text: str, start: str, end: str | None) -> str:
    """Lines of ``text`` from the heading ``start`` (or the top, if empty) up to the heading ``end``."""
    lines = text.splitlines()
    first = 0 if not start else next(i for i, line in enumerate(lines) if line.strip() == start)
    last = len(lines) if end is None else next(i for i, line in enumerate(lines) if i > first and
                                                   line.strip() == end)
    return "\n".join(lines[first:last]).strip() + "\n"


def _config_page() -> str:
    source = (ROOT / SOURCES["configuration.md"]).read_text()
    tree = ast.parse(source)
    sets: dict[str, list[str]] = {}
    env: list[str] = []
    manager = ast.parse((ROOT / "core/src/kernels_core/_manager.py").read_text())
    for node in [*tree.body, *manager.body]:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
            if name in CONFIG_KEYS and isinstance(value, ast.Call) and value.args:
                sets[name] = sorted(ast.literal_eval(value.args[0]))
            elif name.startswith("ENV_") and isinstance(value, ast.Constant):
                env.append(value.value)
    parts = ["# Configuration reference", "",
             "Generated from `kernels_core/_config.py` at build time. A dict or TOML path passed as `config=`, the "
             "file named by `KERNELS_CORE_CONFIG`, or `kernels.toml` / `[tool.kernels-core]` in `pyproject.toml` in "
             "the working directory. Precedence: argument > environment > file > plugin priorities; layers merge "
             "key by key, so a higher layer overrides only what it names. Unknown keys raise `ConfigError` naming "
             "the allowed ones.", ""]
    for set_name, (where, described) in CONFIG_KEYS.items():
        keys = sets.get(set_name)
        if keys is None:
            log.warning("configuration page: %s not found in %s", set_name, SOURCES["configuration.md"])
            continue
        parts += [f"## {where}", "", "| key | meaning |", "|---|---|"]
        for key in keys:
            if key not in described:
                log.warning("configuration page: key %r of %s has no description in docs/_hooks.py", key, set_name)
            parts.append(f"| `{key}` | {described.get(key, '')} |")
        parts.append("")
    parts += ["## Environment variables", "", "| variable | meaning |", "|---|---|"]
    for name in sorted(set(env)):
        if name not in ENV_VARS:
            log.warning("configuration page: %s has no description in docs/_hooks.py", name)
        parts.append(f"| `{name}` | {ENV_VARS.get(name, '')} |")
    parts += ["", "## Example", "", "```toml", _section((ROOT / "README.md").read_text(), "", None)
              .split("```toml\n", 1)[1].split("```", 1)[0].rstrip(), "```", ""]
    return "\n".join(parts)


def _report_module():
    spec = importlib.util.spec_from_file_location("_benchmarks_report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_files(files: Files, config: MkDocsConfig) -> Files:
    readme = (ROOT / "README.md").read_text()
    pages = {
        "index.md": _section(readme, "", "## Packages"),
        "verification.md": "# Verification matrix\n\n"
        + _section(readme, "### What was verified where", "## Writing a plugin").split("\n", 1)[1],
        "plugins.md": (ROOT / SOURCES["plugins.md"]).read_text(),
        "kernel-conventions.md": (ROOT / SOURCES["kernel-conventions.md"]).read_text(),
        "configuration.md": _config_page(),
    }
    report = _report_module()
    results = report.load_results()
    pages["benchmarks.md"] = report.page(results, chart_dir="charts")
    for name, svg in report.charts(results).items():
        files.append(File.generated(config, f"charts/{name}", content=svg))
    for name, content in pages.items():
        files.append(File.generated(config, name, content=content))
    return files


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    # The integrations page is written beside the code that it describes; leave it out of the nav until it exists.
    docs = Path(config["docs_dir"])
    config["nav"] = [entry for entry in config["nav"]
                     if not (isinstance(entry, dict) and list(entry.values()) == ["integrations.md"]
                             and not (docs / "integrations.md").exists())]
    return config


_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    source = SOURCES.get(page.file.src_uri)
    if source is None:
        return markdown
    base = posixpath.dirname(source)

    def fix(match: re.Match) -> str:
        text, target = match.groups()
        if re.match(r"^[a-z]+:|^#|^/", target):
            return match.group(0)
        path, _, anchor = target.partition("#")
        repo_path = posixpath.normpath(posixpath.join(base, path))
        if repo_path in PAGE_OF:
            return f"[{text}]({PAGE_OF[repo_path]}{'#' + anchor if anchor else ''})"
        return text if f"`{repo_path}`" in text else f"{text} (`{repo_path}`)"

    return _LINK.sub(fix, markdown)
