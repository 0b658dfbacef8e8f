"""The checks of a fresh build of the kernels, run in a child process (builds.self_check):
`python -I -S check.py CHECK library.so` prints "ok" when the library passes CHECK; a build whose
instructions fault here kills this child only, never the user's process.

- `kernels` (every build): exact small-integer products through the float32, int8 and Q8_0 / Q4_0
  block kernels. Every block scale is 1 and every x an integer of at most 127 (127 in each block of
  32), so that rounding x to 8 bits changes nothing and every build must give the same sums.
- `amx` (builds.amx_unusable): the operating system grants this process AMX's tile state
  (attnlab_amx_permitted) and a float32 product on the tiles gives the exact sums. The product has
  odd shapes (rows, d_in and d_out no multiple of a tile) and a bias; every value is a small
  integer or a half, exact in float32 and in any order of summation.

The functions' signatures come from the one table (../interface.py, loaded by its path: this child
imports nothing of attnlab, which would import torch); each is declared just before its first
call, so that a library holding only the first function still reaches it.
"""

import ctypes
import importlib.util
import struct
import sys
from pathlib import Path


def declared(lib: ctypes.CDLL, name: str):
    """lib's function `name`, declared as interface.FUNCTIONS says."""
    spec = importlib.util.spec_from_file_location(
        "attnlab_kernels_interface", Path(__file__).parents[1] / "interface.py"
    )
    interface = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(interface)
    return getattr(interface.declare(lib, [name]), name)


def kernels(lib: ctypes.CDLL) -> None:
    """Exact small-integer products through the float32, int8 and Q8_0 / Q4_0 block kernels."""
    d_in, d_out = 256, 6
    x = [127.0 if i % 32 == 5 else float((7 * i) % 23 - 11) for i in range(d_in)]
    w = [[(3 * i + 5 * o) % 15 - 7 for i in range(d_in)] for o in range(d_out)]
    want = [sum(a * b for a, b in zip(x, row)) for row in w]

    def buf(fmt, v):
        return ctypes.create_string_buffer(struct.pack(f"<{len(v)}{fmt}", *v), 8 * len(v))

    def out():
        return ctypes.create_string_buffer(4 * d_out)

    def got(o):
        return list(struct.unpack(f"<{d_out}f", o.raw[: 4 * d_out]))

    X = buf("f", x)
    y = out()
    linear_f32 = declared(lib, "attnlab_linear_f32")
    linear_f32(X, buf("f", [float(v) for r in w for v in r]), None, y, 1, d_in, d_out, 0, 1)
    assert got(y) == want, ("f32", got(y), want)
    y = out()
    linear_i8 = declared(lib, "attnlab_linear_i8")
    scale = buf("f", [1.0] * d_out)
    linear_i8(X, buf("b", [v for r in w for v in r]), scale, None, y, 1, d_in, d_out, 0, 1)
    assert got(y) == want, ("int8", got(y), want)
    scratch_bytes = declared(lib, "attnlab_linear_q_scratch")
    linear_q = declared(lib, "attnlab_linear_q")
    one = struct.pack("<e", 1.0)  # every block scale
    q8 = b"".join(one + struct.pack("<32b", *r[i : i + 32]) for r in w for i in range(0, d_in, 32))
    q4 = b"".join(
        one + bytes(((r[i + j] + 8) | ((r[i + j + 16] + 8) << 4)) for j in range(16))
        for r in w
        for i in range(0, d_in, 32)
    )
    for kind, blocks in ((0, q8), (1, q4)):
        scratch = ctypes.create_string_buffer(scratch_bytes(1, d_in) + 64)
        aligned = ctypes.addressof(scratch) + (-ctypes.addressof(scratch) % 64)
        y = out()
        weights = ctypes.create_string_buffer(blocks, len(blocks))
        linear_q(X, weights, None, y, aligned, 1, d_in, d_out, kind, 0, 1)
        assert got(y) == want, (kind, got(y), want)
    print("ok")


def amx(lib: ctypes.CDLL) -> None:
    """The tile state granted, then an exact float32 product on the tiles."""
    if declared(lib, "attnlab_amx_permitted")() != 1:
        sys.exit("this CPU or its operating system does not let a process run AMX tiles")
    rows, d_in, d_out = 37, 70, 45
    x = [((5 * r + 3 * i) % 17 - 8) / 2 for r in range(rows) for i in range(d_in)]
    w = [(7 * o + 2 * i) % 13 - 6.0 for o in range(d_out) for i in range(d_in)]
    b = [o - 20.0 for o in range(d_out)]
    want = [
        sum(x[r * d_in + i] * w[o * d_in + i] for i in range(d_in)) + b[o]
        for r in range(rows)
        for o in range(d_out)
    ]
    scratch_bytes = declared(lib, "attnlab_linear_amx_scratch")
    scratch = ctypes.create_string_buffer(scratch_bytes(rows, d_in, d_out, 2) + 64)

    def buf(v):
        return ctypes.create_string_buffer(struct.pack(f"<{len(v)}f", *v), 4 * len(v))

    y = ctypes.create_string_buffer(4 * rows * d_out)
    declared(lib, "attnlab_linear_amx")(buf(x), buf(w), buf(b), y, scratch, rows, d_in, d_out, 2)
    got = list(struct.unpack(f"<{rows * d_out}f", y.raw))
    assert got == want, ("amx", [(g, v) for g, v in zip(got, want) if g != v][:3])
    print("ok")


CHECKS = {"kernels": kernels, "amx": amx}

if __name__ == "__main__":
    CHECKS[sys.argv[1]](ctypes.CDLL(sys.argv[2]))
