"""This process's peak resident set, read as the C++ side reads it (io/cpu_memory.h,
peak_rss_bytes): /proc/self/status VmHWM, which starts again at exec. resource.getrusage's
ru_maxrss does not fit: Linux carries it across exec, so a peer started from a large parent would
report the parent's peak. The one reader for the bench scripts and the peers they start.
"""
import os

HERE = os.path.dirname(os.path.abspath(__file__))

# Prepended to a `python -c` peer's source, whose sys.path does not hold bench/.
SNIPPET_IMPORT = f"import sys; sys.path.insert(0, {HERE!r}); from peak_rss import peak_rss_bytes\n"


def peak_rss_bytes():
    """VmHWM in bytes, -1 where /proc/self/status lacks it."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    return -1
