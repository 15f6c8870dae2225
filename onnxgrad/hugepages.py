"""glibc's huge-page tunable for the commands that run graphs. Nothing here imports onnx or onnxruntime: the
command starts again before it loads them."""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping

# Each tensor of a budgeted run is a map of its own (`runtime.follow_live_bytes`), whose pages the kernel faults in
# 4 KiB at a time. With this tunable glibc asks for transparent huge pages on its maps (madvise), and the kernel
# faults them in 2 MiB at a time: ResNet-50's budgeted training steps with the arena off took 35-39% less time, at
# the same peak (BENCHMARKS.md, "Huge pages"). glibc reads its tunables when the process starts, so `onnxgrad run`,
# `train` and `check` start again with it (`start_with_huge_pages`). A GLIBC_TUNABLES that names
# glibc.malloc.hugetlb is left as it is.
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """`env` with glibc's huge-page tunable added, or None where it would change nothing: not Linux with glibc
    2.35 or later, the kernel's transparent huge pages not in `madvise` mode (`always` gives them to every map
    already, `never` to none), or GLIBC_TUNABLES already says glibc.malloc.hugetlb."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if not sys.platform.startswith("linux") or "glibc.malloc.hugetlb" in tunables:
        return None
    try:
        name, _, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").partition(" ")
        if name != "glibc" or tuple(int(x) for x in version.split(".")[:2]) < (2, 35):
            return None
        with open(_THP_MODE) as f:
            if "[madvise]" not in f.read():
                return None
    except (OSError, ValueError):
        return None
    return {**env, "GLIBC_TUNABLES": f"{tunables}:{HUGE_PAGES_TUNABLE}" if tunables else HUGE_PAGES_TUNABLE}


def start_with_huge_pages() -> None:
    """Replace this process by the same command with glibc's huge-page tunable set (`huge_pages_env`); return
    where that would change nothing or the command cannot be started again."""
    env = huge_pages_env(os.environ)
    argv = getattr(sys, "orig_argv", None)
    if env is None or not sys.executable or not argv:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *argv[1:]], env)
    except OSError:
        return
