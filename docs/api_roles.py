"""A Griffe extension (mkdocs.yml, mkdocstrings' ``extensions``): the Sphinx roles of the package's docstrings
(``:func:`name```, ``:class:`~.module.Name```, ``:mod:`.module```, ``:meth:``, ``:attr:``, ``:data:``, ``:exc:``,
``:obj:``) rendered on the API reference as cross-references: each name is resolved where its docstring stands (its
object, then the enclosing class and module; a leading dot is relative to the module's package, a ``~`` shows the
last part only) and becomes a link where the site documents the target, inline code where it does not (a private
helper, a module the reference leaves out). The docstrings' lists, nested by 2 spaces as in the pages, are nested as
the site's Markdown reads them (``generate.site_lists``). The docstrings stay as Python's ``help()`` shows them; only
the site's rendering changes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import griffe

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import generate  # noqa: E402

ROLE = re.compile(r":(?:py:)?(?P<role>func|class|meth|mod|attr|data|obj|exc|const):`(?P<target>[^`]+)`")


def _lookup(pkg: griffe.Object, path: str) -> griffe.Object | None:
    """The object at the dotted ``path`` under the package's root, or None."""
    root, _, rest = path.partition(".")
    if root != pkg.name:
        return None
    obj = pkg
    for part in rest.split(".") if rest else []:
        try:
            obj = obj.members[part]
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None
    return obj


def _module_of(obj: griffe.Object) -> griffe.Object:
    while not obj.is_module:
        obj = obj.parent
    return obj


def resolve(obj: griffe.Object, pkg: griffe.Object, name: str) -> str | None:
    """The full path ``name`` stands for in ``obj``'s docstring, or None where it resolves to nothing known."""
    module = _module_of(obj)
    candidates = []
    if name.startswith("."):  # relative: the module's own members, then its package's
        candidates += [module.path + name, (module.parent.path if module.parent else module.path) + name]
    else:
        candidates.append(name)  # already a full path
        scope = obj
        while scope is not None:  # the object, then each enclosing class and module
            candidates.append(f"{scope.path}.{name}")
            head = name.split(".")[0]
            if head in scope.imports:
                candidates.append(scope.imports[head] + name[len(head):])
            scope = scope.parent
    for path in candidates:
        found = _lookup(pkg, path)
        if found is not None:
            try:
                return found.final_target.path if found.is_alias else found.path
            except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                return found.path
    return None


def render(obj: griffe.Object, pkg: griffe.Object, text: str) -> str:
    """``text`` with each Sphinx role replaced by an optional cross-reference (inline code where its target is not on
    the site: autorefs leaves an unresolved optional reference as its title)."""

    def one(match: re.Match) -> str:
        target = match.group("target").strip()
        short = target.startswith("~")
        name = target.lstrip("~")
        shown = name.rsplit(".", 1)[-1] if short else name.lstrip(".")
        if match.group("role") in ("func", "meth"):
            shown += "()"
        path = resolve(obj, pkg, name)
        if path is None:
            return f"`{shown}`"
        return f'<autoref identifier="{path}" optional><code>{shown}</code></autoref>'

    return ROLE.sub(one, text)


def _walk(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)


class SphinxRoles(griffe.Extension):
    """Rewrites the docstrings of the package, once it is loaded, as :func:`render` and ``site_lists`` say."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = generate.site_lists(render(obj, pkg, obj.docstring.value))
