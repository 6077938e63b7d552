"""A reader that stops reading (``vlcontrast config | head -1``) ends a command's printing
without a traceback: status 1, as Python's documented handling of a broken pipe has it."""

import os
import subprocess
import sys


def test_a_closed_stdout_is_no_traceback():
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write: every write fails (EPIPE)
    try:
        proc = subprocess.run([sys.executable, "-m", "vlcontrast", "config"], stdout=write,
                              stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(write)
    err = proc.stderr.decode()
    assert proc.returncode == 1, err[-2000:]
    assert "Traceback" not in err and "BrokenPipeError" not in err, err[-2000:]
