"""A process's cores belong to the one thread that computes: the server's model thread, a command's or a
job's main thread.

torch's OpenMP runtime keeps a team of worker threads for every thread that runs a parallel op. Once two
threads own teams there are more OpenMP threads than cores, and the runtime stops spinning between
parallel regions: every op of the computing thread then waits for its workers to wake (a decode step on
this 2-core machine: 55 ms when one thread runs torch, 76 ms once another has too). So every other thread
that runs torch (the server's prep thread, side worker, KV loaders and layer-wise decoders; a job's KV writer) runs it on one
core and starts no team: `one_core()`.

torch keeps the count per thread, but `set_num_threads` also sets the process-wide default that a thread
reads on its first parallel op. A computing thread therefore claims its count with `claim_cores` (read,
then set): what a helper sets later no longer reaches it.

The threads also share one interpreter lock, and torch gives it up for every op: a thread that wants it
back waits until the holder's switch interval (5 ms by default) runs out. Beside a thread busy in Python
(an ingest: chunking, SQL rows), the computing thread's hundreds of small ops a forward pass each wait that
long (500 small ops on one core: 4.6 ms alone, 1.3–1.6 s beside a Python loop; 149 ms at a 0.5 ms interval,
58 ms at 0.1 ms). A server hands the lock over sooner: `hand_over_quickly()`.
"""
from __future__ import annotations

import sys

import torch

SWITCH_S = 0.0001  # the interpreter lock's switch interval in a server; an uncontended thread never pays it


def one_core() -> None:
    """Run this thread's torch ops on it alone."""
    torch.set_num_threads(1)


def claim_cores(n: int | None = None) -> None:
    """This thread computes on `n` cores (None: torch's default), whatever other threads set later."""
    have = torch.get_num_threads()  # this thread takes its count now, not at its first parallel op
    if n and n != have:
        torch.set_num_threads(n)


def hand_over_quickly() -> None:
    """Threads of this process wait at most SWITCH_S for the interpreter lock (process-wide)."""
    sys.setswitchinterval(SWITCH_S)
