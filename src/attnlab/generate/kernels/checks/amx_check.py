"""The AMX product's check, run in a child process (builds.amx_unusable): `python -I -S
amx_check.py library.so` prints "ok" when the operating system grants this process AMX's tile
state (attnlab_amx_permitted) and a float32 product on the tiles gives the exact sums.

The product has odd shapes (rows, d_in and d_out no multiple of a tile) and a bias; every value is
a small integer or a half, exact in float32 and in any order of summation. A fault costs this
child only. The functions' signatures come from the one table (../interface.py, loaded by its
path: this child imports nothing of attnlab, which would import torch).
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


def main(path: str) -> None:
    lib = ctypes.CDLL(path)
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


if __name__ == "__main__":
    main(sys.argv[1])
