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
from collections.abc import Iterable
from importlib.metadata import entry_points
from typing import Any, TypeVar

Spec = TypeVar("Spec")

LEFT_OUT: dict[tuple[str, str], str] = {}  # (group, name) -> why that plug-in was left out


def load(target: str) -> Any:
    """What a `module:attribute` string names (the registry's way of naming code), its module imported now."""
    module, attribute = target.split(":")
    return getattr(importlib.import_module(module), attribute)


def plugged(group: str, kind: type[Spec], builtin: Iterable[Spec]) -> dict[str, Spec]:
    """The built-in specs by name, then each plug-in of the entry-point `group` (each a `kind`), in name order."""
    table = {spec.name: spec for spec in builtin}  # type: ignore[attr-defined]
    for point in sorted(entry_points(group=group), key=lambda point: point.name):
        problem = None
        try:
            spec = point.load()
        except Exception as error:  # noqa: BLE001 -- any failure of a third party's import is reported, not raised
            problem = f"it did not load ({type(error).__name__}: {error})"
        else:
            if not isinstance(spec, kind):
                problem = f"it is a {type(spec).__name__}, not a {kind.__name__}"
            elif spec.name != point.name:  # type: ignore[attr-defined]
                problem = f"its spec is named {spec.name!r}; name the entry point as the spec"  # type: ignore[attr-defined]
            elif point.name in table:
                problem = f"{point.name!r} is built in; give the plug-in another name"
        if problem:
            LEFT_OUT[group, point.name] = f"plug-in {point.name} = {point.value} ({group}): {problem}"
            print(f"clipdist: warning: {LEFT_OUT[group, point.name]}; it is left out", file=sys.stderr)
        else:
            table[point.name] = spec
    return table


def left_out(group: str, name: str) -> str:
    """Why a plug-in of that name was left out ("" where none was): for the error that says `name` is unknown."""
    reason = LEFT_OUT.get((group, name))
    return f" ({reason})" if reason else ""
