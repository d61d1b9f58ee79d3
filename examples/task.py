"""A task for `rollbox run examples/task.py`: the file runs as __main__ in a fresh sandbox (its own
namespaces, a non-root user, the snapshot's Python), which is destroyed when it ends.

    .venv/bin/rollbox run examples/task.py            # its output, and its exit status
    .venv/bin/rollbox run --json examples/task.py     # the whole result record
"""

import os
import socket

squares = [n * n for n in range(10)]
print(f"sum of the squares below 10: {sum(squares)}")
print(f"uid {os.getuid()} on host {socket.gethostname()!r}")
