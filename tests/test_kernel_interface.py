"""The C kernels' interface, checked against the C source: the one table
(attnlab.generate.kernels.interface.FUNCTIONS) has a row for every exported function of the C
source (every non-static attnlab_* function defined in a *.c file under kernels.C_FOLDER) and
no other, each with the C function's result and parameter types; the loader declares them so;
the C enums (op kinds, block types, activations) are the Python enums in the same order.

The C source is read as text: comments dropped, then each definition at the start of a line
(`type attnlab_name(parameters) {`); a function defined more than once (one body per #if
branch) must have one signature. A pointer of any type is a void pointer to ctypes.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from attnlab.generate import kernels
from attnlab.generate.kernels.interface import CPU_FUNCTIONS, FUNCTIONS, KERNEL_FUNCTIONS

C_TYPES = {
    "void": None,
    "int": ctypes.c_int,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "uint64_t": ctypes.c_uint64,
    "size_t": ctypes.c_size_t,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}
DEFINITION = re.compile(
    r"^(?P<result>[A-Za-z_][\w \t*]*?)[ \t*]*\b(?P<name>attnlab_\w+)"
    r"\s*\((?P<parameters>[^)]*)\)\s*\{",
    re.M,
)

ANY_DEFINITION = re.compile(r"\b(attnlab_\w+)\s*\([^;{}()]*\)\s*\{")


def without_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", " ", text, flags=re.S))


def c_type(declaration: str, where: str) -> type | None:
    """The ctypes type of a C parameter (`const float *x`) or result (`int64_t`)."""
    if "*" in declaration or "[" in declaration:
        return ctypes.c_void_p
    # (a macro in capitals before a definition is an attribute: AMX_TARGET)
    words = [
        w
        for w in declaration.split()
        if w not in ("const", "static", "inline", "extern") and not re.fullmatch(r"[A-Z_0-9]+", w)
    ]
    name = words[0] if len(words) == 1 else " ".join(words[:-1])
    assert name in C_TYPES, f"{where}: a C type the interface test does not know: {declaration!r}"
    return C_TYPES[name]


def c_functions(folder: Path = kernels.C_FOLDER) -> dict[str, tuple[type | None, list]]:
    """{name: (result type, parameter types)} of every non-static attnlab_* function defined in
    the *.c files under `folder`."""
    found: dict[str, tuple[type | None, list]] = {}
    for path in sorted(folder.rglob("*.c")):
        text = without_comments(path.read_text(encoding="utf-8"))
        read = set()
        for match in DEFINITION.finditer(text):
            result, name = match["result"], match["name"]
            read.add(name)
            if "static" in result.split():
                continue
            where = f"{path.name}: {name}"
            parameters = [" ".join(p.split()) for p in match["parameters"].split(",")]
            if parameters in ([""], ["void"]):
                parameters = []
            pointer = "*" in match.group(0)[: match.start("name") - match.start()]
            signature = (
                ctypes.c_void_p if pointer else c_type(result, where),
                [c_type(p, where) for p in parameters],
            )
            assert found.setdefault(name, signature) == signature, f"{where}: two signatures"
        # every definition, however written, must be one the pattern above reads
        unread = {m[1] for m in ANY_DEFINITION.finditer(text)} - read
        assert not unread, f"{path.name}: definitions the interface test cannot read: {unread}"
    return found


C_FUNCTIONS = c_functions()


def c_enum(name: str) -> list[str]:
    """The items of `typedef enum { ... } name;` in the C source (its *.c and *.h files)."""
    texts = [p.read_text(encoding="utf-8") for p in sorted(kernels.C_FOLDER.rglob("*.[ch]"))]
    for text in texts:
        body = re.search(r"typedef enum \{([^}]*)\} " + name + ";", text)
        if body is not None:
            items = without_comments(body.group(1)).split(",")
            return [item.split("=")[0].strip() for item in items if item.strip()]
    raise AssertionError(f"the C source has no enum {name}")


def test_the_parser_finds_the_c_sources_functions():
    """The parser itself: a definition over several lines, a static one, a pointer result, a
    prototype (no body) and a function under comment."""
    text = (
        "static int attnlab_hidden(int x) { return x; }\n"
        "int64_t attnlab_sum(const float *x,\n    int64_t n, float scale) {\n  return 0;\n}\n"
        "void attnlab_declared(int x);\n/* void attnlab_commented(int x) { } */\n"
        "uint8_t *attnlab_buffer(void) { return 0; }\n"
    )
    found = {m["name"] for m in DEFINITION.finditer(without_comments(text))}
    assert found == {"attnlab_hidden", "attnlab_sum", "attnlab_buffer"}
    assert len(C_FUNCTIONS) >= 40 and "attnlab_run" in C_FUNCTIONS


def test_every_exported_c_function_has_a_row_in_the_table():
    missing = sorted(set(C_FUNCTIONS) - set(FUNCTIONS))
    assert missing == [], f"exported by the C source, not in interface.FUNCTIONS: {missing}"


def test_every_row_of_the_table_is_a_c_function():
    gone = sorted(set(FUNCTIONS) - set(C_FUNCTIONS))
    assert gone == [], f"in interface.FUNCTIONS, no longer in the C source: {gone}"


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_each_row_has_its_c_functions_result_and_parameter_types(name):
    assert name in C_FUNCTIONS, f"{name} is not in the C source"
    result, parameters = C_FUNCTIONS[name]
    assert FUNCTIONS[name].parameters == parameters, name
    assert FUNCTIONS[name].result == result, name


def test_the_loader_declares_every_function_as_the_table_says():
    """`load` (this process's library) sets each function's argument and result types from the
    table, and cpu.c's function is declared apart (a library of its own)."""
    library = kernels.library()
    if library is None:
        pytest.skip(f"no kernels here: {kernels.unavailable()}")
    for name in KERNEL_FUNCTIONS:
        function = getattr(library, name).__wrapped__  # (the argument count's check around it)
        assert function.argtypes == FUNCTIONS[name].parameters, name
        assert function.restype == FUNCTIONS[name].result, name
    assert set(CPU_FUNCTIONS) <= set(C_FUNCTIONS)


def test_the_op_kinds_are_the_c_sources_in_its_order_each_with_its_function():
    assert c_enum("attnlab_op_kind") == [f"OP_{op.name}" for op in kernels.Op]
    assert [op.value for op in kernels.Op] == list(range(len(kernels.Op)))
    for op in kernels.Op:
        parameters = FUNCTIONS[op.function].parameters
        assert FUNCTIONS[op.function].result is None, op  # a program discards results
        # its integers and pointers fit an op's record, its floats in `f`
        assert len(parameters) <= len(kernels.OpCall().a), op
        assert parameters.count(ctypes.c_float) <= len(kernels.OpCall().f), op


def test_the_activation_kinds_are_the_c_sources():
    assert c_enum("attnlab_activation") == [
        f"ACTIVATION_{kind.name}" for kind in kernels.Activation
    ]
    assert set(kernels.ACTIVATIONS.values()) == set(kernels.Activation)


def test_the_block_types_are_the_c_sources_and_the_block_modules():
    from attnlab.quant.blocks import BLOCK_TYPES

    assert c_enum("attnlab_block_type") == [f"BLOCK_{kind.name}" for kind in kernels.BlockKind]
    assert {t.name: t.kernel for t in BLOCK_TYPES.values()} == {
        kind.name: kind.value for kind in kernels.BlockKind
    }
    source = "".join(p.read_text(encoding="utf-8") for p in kernels.C_FOLDER.rglob("*.[ch]"))
    # each block struct's asserted size is the block module's, and BLOCK_BYTES lists the structs in
    # attnlab_block_type's order
    asserted = re.findall(r"_Static_assert\(sizeof\(block_(\w+)\) == (\d+)", source)
    assert {name.upper(): int(size) for name, size in asserted} == {
        kind.name: next(t.nbytes for t in BLOCK_TYPES.values() if t.kernel == kind)
        for kind in kernels.BlockKind
    }
    sizes = re.search(r"BLOCK_BYTES\[\] = \{([^}]*)\}", source).group(1)
    assert re.findall(r"sizeof\(block_(\w+)\)", sizes) == [
        kind.name.lower().replace("_k", "_K") for kind in kernels.BlockKind
    ]


def test_the_build_key_covers_every_c_file_and_header_of_the_sources_folder(tmp_path):
    """A build is cached by what it is compiled from: the unity file, and every *.c and *.h file
    beside it, which it includes."""
    (tmp_path / "kernels.c").write_text('#include "a.h"\n#include "b.c"\n')
    (tmp_path / "a.h").write_text("#define A 1\n")
    (tmp_path / "b.c").write_text("int b(void) { return A; }\n")
    (tmp_path / "notes.txt").write_text("not C\n")
    before = kernels.source_key(tmp_path / "kernels.c")
    (tmp_path / "notes.txt").write_text("still not C\n")
    assert kernels.source_key(tmp_path / "kernels.c") == before
    for name, text in (("a.h", "#define A 2\n"), ("b.c", "int b(void) { return -A; }\n")):
        (tmp_path / name).write_text(text)
        assert kernels.source_key(tmp_path / "kernels.c") != before, name
        before = kernels.source_key(tmp_path / "kernels.c")
    (tmp_path / "c.h").write_text("")  # a new header
    assert kernels.source_key(tmp_path / "kernels.c") != before
