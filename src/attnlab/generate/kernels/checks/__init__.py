"""Programs that check a fresh build of the kernels in a child process (builds.self_check runs them
as `python -I -S program library.so`), so that an instruction that faults here kills the child,
never the user's process. Each prints "ok" when the library computes exact sums, and reads the
C functions' signatures from the one table (interface.py, loaded by its path: the child imports
nothing of attnlab, which would import torch). They are not imported by attnlab."""

from pathlib import Path

SELF_CHECK = Path(__file__).with_name("self_check.py")
AMX_CHECK = Path(__file__).with_name("amx_check.py")
