"""The forked ranks (`rank_server`) end as cold `python` processes end: the same exit code and
the same output, for every way a rank's script ends that the runtime tests meet."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from rank_server import fork_rank

SCRIPTS = {
    "returns": "print('out'); import sys; print('err', file=sys.stderr)",
    "exits 3": "import sys; sys.exit(3)",
    "exits 300": "import sys; sys.exit(300)",
    "exits with a message": "import sys; sys.exit('said')",
    "raises": "raise ValueError('boom')",
    "interrupted": "raise KeyboardInterrupt",
    "joins a thread, then atexit": (
        "import atexit, threading, time\n"
        "atexit.register(lambda: print('atexit', flush=True))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread', flush=True))).start()"
    ),
    "os._exit": "import os; print('lost?', flush=True); os._exit(7)",
    "reads its environment": "import os, sys; print(os.environ['RANK_TEST'], sys.argv[1:])",
    "sees the cwd and the script's folder": (
        "import os, sys; print(os.getcwd() == os.environ['WANT_CWD'], "
        "sys.path[0] == os.path.dirname(os.path.abspath(sys.argv[0])))"
    ),
}


def _cold(argv, env, cwd, log):
    with open(log, "w") as out:
        return subprocess.run([sys.executable, *argv], env=env, cwd=cwd, stdout=out,
                              stderr=out, timeout=60).returncode  # fmt: skip


def _normalised(text: str) -> list[str]:
    """The output, less the traceback's frames (the forked one has runpy's too)."""
    return [line for line in text.splitlines() if not line.startswith(("  ", "Traceback"))]


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_forked_rank_ends_as_a_cold_process(tmp_path, name):
    script = tmp_path / "script.py"
    script.write_text(SCRIPTS[name] + "\n")
    env = {**os.environ, "RANK_TEST": "seven", "WANT_CWD": str(tmp_path / "here")}
    (tmp_path / "here").mkdir()
    argv = [str(script), "a", "b"]
    cold = _cold(argv, env, tmp_path / "here", tmp_path / "cold.log")
    rank = fork_rank(1, argv, env, str(tmp_path / "here"), tmp_path / "forked.log")
    assert rank.wait(60) == cold
    got, want = ((tmp_path / f"{x}.log").read_text() for x in ("forked", "cold"))
    assert _normalised(got) == _normalised(want)


def test_a_forked_module_runs_as_python_m(tmp_path):
    pkg = tmp_path / "pkg_rank_test"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text("import sys; print(__name__, sys.argv[1:]); sys.exit(4)\n")
    argv = ["-m", pkg.name, "x"]
    cold = _cold(argv, dict(os.environ), tmp_path, tmp_path / "cold.log")
    rank = fork_rank(0, argv, dict(os.environ), str(tmp_path), tmp_path / "forked.log")
    assert rank.wait(60) == cold == 4
    assert (tmp_path / "forked.log").read_text() == (tmp_path / "cold.log").read_text()


def test_a_forked_rank_takes_signals_as_a_process(tmp_path):
    """Its own handlers run; Python's own SIGINT handler too (KeyboardInterrupt, then death
    by SIGINT, as a cold interpreter); stopped, it stays alive; killed, its code says which
    signal."""
    script = tmp_path / "wait.py"
    script.write_text(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    ranks = [fork_rank(i, [str(script)], dict(os.environ), None, tmp_path / f"{i}.log")
             for i in range(3)]  # fmt: skip
    for i in range(3):
        while "ready" not in (tmp_path / f"{i}.log").read_text():
            time.sleep(0.05)
    ranks[0].send_signal(signal.SIGTERM)
    ranks[1].send_signal(signal.SIGSTOP)
    ranks[2].send_signal(signal.SIGINT)
    assert ranks[0].wait(30) == 143
    assert ranks[2].wait(30) == -signal.SIGINT
    assert "KeyboardInterrupt" in (tmp_path / "2.log").read_text()
    with pytest.raises(subprocess.TimeoutExpired):
        ranks[1].wait(0.5)
    assert ranks[1].poll() is None
    ranks[1].kill()
    assert ranks[1].wait(30) == -signal.SIGKILL


# A package's first act (templates/package/__init__.py.j2), then the page faults of a fresh
# 64 MB tensor: few on the huge pages torch uses when it loads after prepare_process().
PREPARED = """
import ftpipe_runtime
ftpipe_runtime.prepare_process()
import os, resource, torch
from ftpipe_runtime.job.cpu_allocator import VARIABLE, keep_heap
x = torch.ones(2**24)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
y = x * 2
print(os.environ.get(VARIABLE), keep_heap(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 4000)
"""


def test_a_forked_package_runs_with_the_settings_it_asks_before_torch(tmp_path):
    """A rank started `prepared` was forked from a server that applied the package's process
    settings before torch loaded, as the cold package does itself."""
    pkg = tmp_path / "pkg_prepared_test"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(PREPARED)
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    argv = ["-m", pkg.name]
    assert _cold(argv, env, tmp_path, tmp_path / "cold.log") == 0
    rank = fork_rank(0, argv, env, str(tmp_path), tmp_path / "forked.log", prepared=True)
    assert rank.wait(60) == 0
    assert (tmp_path / "forked.log").read_text() == (tmp_path / "cold.log").read_text()
