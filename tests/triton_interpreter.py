"""Kernel tests under triton's CPU interpreter: TRITON_INTERPRET=1 must be set before triton loads, so
each check runs as a script in a subprocess. `PATCH` is the compatibility fix such a script starts with
where its kernels loop to a runtime bound; `run_interpreted` runs the script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

PATCH = """
import triton.runtime.interpreter as interpreter
# triton 3.6's interpreter calls int() on one-element arrays (a runtime loop bound), which numpy >= 2.3
# refuses: index the element instead
_patch = interpreter._patch_lang_tensor
def _patched(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
interpreter._patch_lang_tensor = _patched
"""


def run_interpreted(script: str) -> None:
    """Run `script` (it prints "ok" last) under the interpreter from the repository root, with tests/
    importable and the caller's PYTHONPATH kept (on the H200 the wheels live there); fail with its
    stderr."""
    paths = (str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", ""))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=TESTS.parent
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
