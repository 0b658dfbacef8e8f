"""The house's shape, checked: the import graph (tests/import_graph.py). (The C kernels'
interface: tests/test_kernel_interface.py.)

- The package's modules import each other in no circle; its rooms (model/, lens/, generate/, ...)
  stand on at most 9 levels, with at most 4 arrows of deferred imports running from a lower level
  up.
"""

from __future__ import annotations

import import_graph

MAX_LEVELS = 9
MAX_UP = 4


def test_the_import_graph_has_no_circle_and_its_rooms_stand_in_few_levels_with_few_arrows_up():
    found = import_graph.measure()
    assert found.circles == [], f"modules importing each other in a loop: {found.circles}"
    assert found.room_circles == [], (
        f"rooms importing each other at import time: {found.room_circles}"
    )
    assert found.n_levels <= MAX_LEVELS, found.room_levels
    assert len(found.up) <= MAX_UP, found.up


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
