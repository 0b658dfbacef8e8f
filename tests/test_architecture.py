"""The house's shape, checked: the import graph (tests/import_graph.py). (The C kernels'
interface: tests/test_kernel_interface.py.)

- The package's modules import each other in no circle; its rooms (model/, lens/, generate/, ...)
  stand on at most 9 levels, with no arrow running from a lower level up.
- The model and the formats import nothing of generation (the C kernels and their layers are
  swapped in by the code that wants them), and the quantized layers (quant/) sit below both the
  formats and generation: they import neither, nor the model.
"""

from __future__ import annotations

import import_graph
import pytest

MAX_LEVELS = 9
MAX_UP = 0


def test_the_import_graph_has_no_circle_and_its_rooms_stand_in_few_levels_with_few_arrows_up():
    found = import_graph.measure()
    assert found.circles == [], f"modules importing each other in a loop: {found.circles}"
    assert found.room_circles == [], (
        f"rooms importing each other at import time: {found.room_circles}"
    )
    assert found.n_levels <= MAX_LEVELS, found.room_levels
    assert len(found.up) <= MAX_UP, found.up


@pytest.mark.parametrize(
    "room, below",
    [
        ("attnlab.model", ("attnlab.generate", "attnlab.workbench")),
        ("attnlab.formats", ("attnlab.generate", "attnlab.workbench")),
        ("attnlab.quant", ("attnlab.generate", "attnlab.formats", "attnlab.model")),
    ],
)
def test_the_plain_rooms_import_nothing_of_the_rooms_above_them(room, below):
    """Every import in `room`'s modules, deferred ones too, reaches none of the rooms in `below`."""
    graph = import_graph.read()
    found = [
        (module, target)
        for module in graph.modules
        if import_graph.room_of(module) == room
        for target in graph.arrows()[module]
        if import_graph.room_of(target) in below
    ]
    assert found == [], f"{room} imports from {below}: {found}"


def test_the_import_graph_sees_a_circle_a_deferred_import_hides(tmp_path):
    """The measure itself: a deferred import that closes a loop is a circle, and an arrow up."""
    package = tmp_path / "attnlab"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "a.py").write_text("def f():\n    from ..high import b\n")
    (package / "high.py").write_text("from .low import a\n")
    found = import_graph.measure(package)
    assert found.circles == [["attnlab.high", "attnlab.low.a"]]
    assert found.up == [("attnlab.low", "attnlab.high")]
    assert found.room_levels == {"attnlab": 1, "attnlab.low": 1, "attnlab.high": 2}
