"""``python -m pagedserve.cli``: the ``pagedserve`` command, run as a module.

The command lives in pagedserve_cli/cli.py, above the services: ``pagedserve up`` derives its flags
from their configs and starts them. This package is the floor below them and imports none of them
(tests/test_imports.py), so this module hands over at a process boundary, as the floor starts the
services themselves (pagedserve/stack.py names them by module): it replaces this process with
``python -m pagedserve_cli.cli`` and the same arguments. The PID, the process group, the standard
streams and the exit status stay the command's, so a terminal's Ctrl-C and a supervisor's signals
reach ``up`` as before.
"""

import os
import sys

if __name__ == "__main__":
    os.execv(sys.executable, [sys.executable, "-m", "pagedserve_cli.cli", *sys.argv[1:]])
