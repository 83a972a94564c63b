"""What the host's CPU says of itself in /proc/cpuinfo. No torch here: `blend.openmp` reads it before torch loads."""

PATH = "/proc/cpuinfo"


def read(path: str = PATH) -> str:
    """The file's text; empty where it cannot be read (not Linux)."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def vendor(info: str) -> str:
    """The first `vendor_id` in cpuinfo text (GenuineIntel, AuthenticAMD, …); empty where none is given."""
    return next((line.split(":")[1].strip() for line in info.splitlines() if line.startswith("vendor_id")), "")


def flags(info: str) -> set[str]:
    """The first `flags` line's features in cpuinfo text (avx2, avx512f, …); empty where none is given."""
    return set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), ()))
