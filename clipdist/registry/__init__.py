"""Every pluggable axis of clipdist in one torch-free registry: each entry its name, a one-line summary, its options
(a dataclass whose fields become config keys, each with its resume rule), its checks and where its code lives,
imported only when a run builds it.

| axis | table | entry-point group | options become |
|---|---|---|---|
| loss backend | `losses.BACKENDS` | `clipdist.losses` | `loss.<option>` under `loss=<name>` |
| loss term | `terms.TERMS` | `clipdist.terms` | `loss.<name>.<option>` |
| data kind | `kinds.KINDS` | `clipdist.kinds` | `data.<name>.<option>` |
| lr schedule | `schedules.SCHEDULES` | `clipdist.schedules` | `optim.<name>.<option>` under `optim.schedule=<name>` |

Every consumer iterates these tables: the config schema, `--help` and the menus' did-you-mean, the checks before any
rank starts, `clipdist gradcheck` and the tests. A component of your own needs no edit to clipdist: an installed
package names its spec in the group's entry points (pyproject.toml), the entry point's name the spec's name:

    [project.entry-points."clipdist.losses"]
    chunked = "my_losses.specs:CHUNKED"        # a LossSpec

A plug-in that does not load, is not its group's spec, or takes a built-in's name is left out with one line on
stderr saying why (so one broken package does not stop every clipdist command); naming it then says the same."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, TypeVar

Spec = TypeVar("Spec")

LEFT_OUT: dict[tuple[str, str], str] = {}  # (group, name) -> why that plug-in was left out


def load(target: str) -> Any:
    """What a `module:attribute` string names (the registry's way of naming code), its module imported now."""
    module, attribute = target.split(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class CodeSpec:
    """What an entry whose code is one callable has (a backend, a term, a schedule): its name, where the code is
    (`module:attribute`, imported by `load` when a run builds it) and a one-line summary for menus and errors."""

    name: str
    target: str
    summary: str

    def load(self, target: str | None = None) -> Any:
        """The callable `target` (default: the entry's own) names, its module imported now."""
        return load(target or self.target)


class Registry(Mapping[str, Spec]):
    """Name -> spec: the built-in specs, then each plug-in of the entry-point `group` (each a `kind`) in name order,
    read at the first lookup — not on import, so a plug-in's own module may import any registry module."""

    def __init__(self, group: str, kind: type[Spec], builtin: Iterable[Spec]):
        self.group, self.kind, self.builtin = group, kind, tuple(builtin)
        self._table: dict[str, Spec] | None = None

    @property
    def table(self) -> dict[str, Spec]:
        if self._table is None:
            self._table = {spec.name: spec for spec in self.builtin}  # type: ignore[attr-defined]
            for point in sorted(entry_points(group=self.group), key=lambda point: point.name):
                self._plug(point)
        return self._table

    def _plug(self, point) -> None:
        assert self._table is not None
        try:
            spec = point.load()
        except Exception as error:  # noqa: BLE001 -- any failure of a third party's import is reported, not raised
            problem = f"it did not load ({type(error).__name__}: {error})"
        else:
            if not isinstance(spec, self.kind):
                problem = f"it is a {type(spec).__name__}, not a {self.kind.__name__}"
            elif spec.name != point.name:  # type: ignore[attr-defined]
                problem = f"its spec is named {spec.name!r}; name the entry point as the spec"  # type: ignore[attr-defined]
            elif point.name in self._table:
                problem = f"{point.name!r} is built in; give the plug-in another name"
            else:
                self._table[point.name] = spec
                return
        LEFT_OUT[self.group, point.name] = f"plug-in {point.name} = {point.value} ({self.group}): {problem}"
        print(f"clipdist: warning: {LEFT_OUT[self.group, point.name]}; it is left out", file=sys.stderr)

    def __getitem__(self, name: str) -> Spec:
        return self.table[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.table)

    def __len__(self) -> int:
        return len(self.table)


def plugged(group: str, kind: type[Spec], builtin: Iterable[Spec]) -> Registry[Spec]:
    """The registry of `builtin` and the plug-ins of entry-point `group` (see Registry)."""
    return Registry(group, kind, builtin)


def left_out(group: str, name: str) -> str:
    """Why a plug-in of that name was left out ("" where none was): for the error that says `name` is unknown."""
    reason = LEFT_OUT.get((group, name))
    return f" ({reason})" if reason else ""
