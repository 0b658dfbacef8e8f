"""The house's shape, checked: the import graph (tests/import_graph.py) and the C kernels'
interface.

- The package's modules import each other in no circle; its rooms (model/, lens/, generate/, ...)
  stand on at most 9 levels, with no arrow running from a lower level up.
- The model and the formats import nothing of generation (the C kernels and their layers are
  swapped in by the code that wants them), and the quantized layers (quant/) sit below both the
  formats and generation: they import neither, nor the model.
- decode.c and attnlab.generate.kernels describe the same program: the same op kinds in the same
  order, each kernel with the same parameter types, and the same activation kinds.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import import_graph
import pytest

from attnlab.generate import kernels

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


DECODE_C = Path(kernels.SOURCE).read_text(encoding="utf-8")


def c_enum(name: str) -> list[str]:
    body = re.search(r"typedef enum \{([^}]*)\} " + name + ";", DECODE_C)
    assert body is not None, f"decode.c has no enum {name}"
    without_comments = re.sub(r"/\*.*?\*/", "", body.group(1), flags=re.S)
    return [item.strip() for item in without_comments.split(",") if item.strip()]


def c_parameters(function: str) -> list[type]:
    """The ctypes type of each parameter of decode.c's `void function(...)` (or int64_t)."""
    found = re.search(r"\b(?:void|int64_t) " + function + r"\((.*?)\)\s*\{", DECODE_C, re.S)
    assert found is not None, f"decode.c has no function {function}"
    types = []
    for parameter in found.group(1).split(","):
        parameter = " ".join(parameter.split())
        if "*" in parameter:
            types.append(ctypes.c_void_p)
        else:
            types.append(
                {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float}[
                    parameter.split()[0]
                ]
            )
    return types


def test_the_op_kinds_are_decode_cs_in_its_order():
    assert c_enum("attnlab_op_kind") == [f"OP_{op.name}" for op in kernels.Op]
    assert [op.value for op in kernels.Op] == list(range(len(kernels.Op)))
    assert list(kernels.KERNELS) == list(kernels.Op)  # one C function per op, in the table


@pytest.mark.parametrize("op", list(kernels.Op), ids=lambda op: op.name)
def test_each_kernels_parameters_are_the_tables(op):
    function, argtypes = kernels.KERNELS[op]
    assert c_parameters(function) == argtypes
    assert len(argtypes) <= len(kernels.OpCall().a)  # an op's arguments fit its record


def test_the_program_runner_and_the_activation_kinds_are_decode_cs():
    assert c_parameters(kernels.RUN[0]) == kernels.RUN[1]
    assert c_parameters(kernels.GENERATE_GREEDY[0]) == kernels.GENERATE_GREEDY[1]
    assert c_enum("attnlab_activation") == [
        f"ACTIVATION_{kind.name}" for kind in kernels.Activation
    ]
    assert set(kernels.ACTIVATIONS.values()) == set(kernels.Activation)


def test_the_block_types_are_decode_cs_and_the_block_modules():
    from attnlab.quant.blocks import BLOCK_TYPES

    assert c_enum("attnlab_block_type") == [f"BLOCK_{kind.name}" for kind in kernels.BlockKind]
    assert {t.name: t.kernel for t in BLOCK_TYPES.values()} == {
        kind.name: kind.value for kind in kernels.BlockKind
    }
    sizes = re.search(r"BLOCK_BYTES\[\] = \{([^}]*)\}", DECODE_C).group(1)
    assert [int(v) for v in sizes.split(",")] == [
        next(t.nbytes for t in BLOCK_TYPES.values() if t.kernel == kind)
        for kind in kernels.BlockKind
    ]
    # the scratch-size function the loader declares (it returns a size: not an op)
    found = re.search(r"\bint64_t " + kernels.SCRATCH[0] + r"\((.*?)\)", DECODE_C)
    assert found is not None and found.group(1).count("int64_t") == len(kernels.SCRATCH[1])


def test_the_prompt_products_and_attention_steps_are_decode_cs():
    """The functions outside the step programs that the loader declares: their parameters as
    decode.c has them."""
    for name, argtypes in (*kernels.LINEAR_ROWS, kernels.ATTEND_ROWS, *kernels.ATTEND_STEPS):
        assert c_parameters(name) == argtypes, name
