"""peak_rss_bytes: a command's own memory high-water mark, not the one of the process that started it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llama_tools.outputs.progress import peak_rss_bytes

CHILD = ("import resource; from llama_tools.outputs.progress import peak_rss_bytes; "
         "print(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_a_child_reports_its_own_peak_not_its_parents():
    big = bytearray(400 * 2**20)  # the parent's RSS grows by 400 MiB (touched, so resident)
    for i in range(0, len(big), 4096):
        big[i] = 1
    assert peak_rss_bytes() > 400 * 2**20
    own, inherited = map(int, subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                                             check=True).stdout.split())
    assert own < 300 * 2**20, own  # a Python with llama_tools imported: tens of MB
    # Negative: ru_maxrss survives fork + exec, so it would have reported the parent's 400 MiB as the child's.
    assert inherited > 400 * 2**20, inherited
    del big
