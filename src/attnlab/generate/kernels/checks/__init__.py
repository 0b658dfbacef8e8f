"""The check program (check.py) that builds.self_check runs on a fresh build of the kernels in a
child process, `python -I -S check.py CHECK library.so`: CHECK is SELF_CHECK for every build,
AMX_CHECK for the AMX products. It is not imported by attnlab (the child imports nothing of it)."""

from pathlib import Path

PROGRAM = Path(__file__).with_name("check.py")
SELF_CHECK = "kernels"
AMX_CHECK = "amx"
