"""`hf-fsdp2 run COMMAND` (issue 65): the command is what the shell or scheduler sees (signals reach it, its status
is the shell's), the environment's own sitecustomize keeps working, two installs do not recurse, and processes
that import neither Accelerate nor the Trainer do not load hf_fsdp2 (hf_fsdp2/startup/sitecustomize.py). That it
still registers in every process of a real launch: tests/test_accelerate_scripts.py, tests/test_trl.py."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_fsdp2.cli import STARTUP, _python_without_pythonpath

SWITCH = [sys.executable, "-m", "hf_fsdp2.cli", "run"]  # `hf-fsdp2 run`, with this interpreter
PY = sys.executable
# Waits for a signal; on SIGTERM says so and exits 0; on Ctrl-C cleans up for a second first, then dies of it.
# Short sleeps, not one of 60 s: Python runs a signal's handler between bytecodes, so a signal landing after its
# last check but before the sleep's syscall blocks waits out the whole sleep (CI under load hit that: 30 s, no output).
WAITER = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(0)))
try:
    print("ready", os.getpid(), flush=True)
    for _ in range(600):
        time.sleep(0.1)
except KeyboardInterrupt:
    time.sleep(1)
    print("cleaned up", flush=True)
    raise
"""


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_FSDP2", "PYTHONPATH")}
    return {**env, **extra}


def _shell_status(cmd: list[str]) -> str:
    """`$?` after `cmd`, as sh reports it."""
    return subprocess.run(["sh", "-c", f"{shlex.join(cmd)}; echo $?"], capture_output=True, text=True, timeout=120,
                          env=_env()).stdout.split()[-1]


def _signalled(cmd: list[str], sig: int, group: bool) -> tuple[int, str]:
    """(status, output) of `cmd` running WAITER, sent `sig` once ready (to its process group: Ctrl-C)."""
    # Started with SIGINT at its default, as a terminal's foreground job is: a test run launched in the background
    # of a non-interactive shell (`... &`, as CI may be) ignores SIGINT, every child inherits that, and Python then
    # installs no KeyboardInterrupt handler: the Ctrl-C case would wait out its timeout, bare as under the switch.
    proc = subprocess.Popen(cmd + [PY, "-c", WAITER], stdout=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        ready = proc.stdout.readline()
        assert ready.startswith("ready"), ready
        (os.killpg if group else os.kill)(proc.pid, sig)
        out, _ = proc.communicate(timeout=30)
        return proc.returncode, ready.split()[0] + "\n" + out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_the_commands_status_after_a_signal_is_the_shells():
    """Killed by a signal: 143 (SIGTERM), 137 (SIGKILL), as the bare command (was 241 / 247)."""
    for sig, status in ((signal.SIGTERM, "143"), (signal.SIGKILL, "137")):
        kill = [PY, "-c", f"import os; os.kill(os.getpid(), {int(sig)})"]
        assert _shell_status(kill) == status
        assert _shell_status(SWITCH + kill) == status
    assert _shell_status(SWITCH + [PY, "-c", "raise SystemExit(3)"]) == "3"
    assert _shell_status(SWITCH + ["no-such-command-hf-fsdp2"]) == "127"  # as sh says for a command not found


def test_sigterm_and_ctrl_c_reach_the_command_as_without_the_switch():
    """A scheduler's SIGTERM to `hf-fsdp2 run` reaches the command (it used to keep running after the wrapper died);
    Ctrl-C lets the command clean up and exit as it would bare (it used to be killed 0.25 s later, traceback)."""
    for sig, group, expected in ((signal.SIGTERM, False, (0, "ready\ngot SIGTERM\n")),
                                 (signal.SIGINT, True, (-signal.SIGINT, "ready\ncleaned up\n"))):
        assert _signalled([], sig, group) == expected
        assert _signalled(SWITCH, sig, group) == expected


def test_processes_that_train_nothing_do_not_load_hf_fsdp2_and_the_environments_sitecustomize_stays(tmp_path):
    """`python -c ...` under the switch imports neither torch nor hf_fsdp2 and says nothing; the environment's own
    sitecustomize ran and is what `import sitecustomize` gives (its attributes were lost)."""
    (tmp_path / "sitecustomize.py").write_text("MARK = 'users'\n")
    probe = ("import sys, sitecustomize; print(sitecustomize.MARK, 'torch' in sys.modules, "
             "any(m.split('.')[0] == 'hf_fsdp2' for m in sys.modules))")
    proc = subprocess.run(SWITCH + [PY, "-c", probe], capture_output=True, text=True, timeout=120,
                          env=_env(PYTHONPATH=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["users", "False", "False"]
    assert "hf_fsdp2" not in proc.stderr


def test_two_installs_on_pythonpath_do_not_recurse(tmp_path):
    """`hf-fsdp2 run hf-fsdp2 run ...` through a second install (a copy of the package) puts both start-up folders
    on PYTHONPATH: each took the other's sitecustomize for the environment's, until RecursionError."""
    copy = tmp_path / "copy" / "hf_fsdp2"
    shutil.copytree(STARTUP, copy / "startup")
    shutil.copytree(STARTUP.parent / "runtime", copy / "runtime")
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "sitecustomize.py").write_text("RUNS = globals().get('RUNS', 0) + 1\n")
    path = os.pathsep.join([str(copy / "startup"), str(STARTUP), str(tmp_path / "user")])
    proc = subprocess.run([PY, "-c", "import sitecustomize; print(sitecustomize.RUNS)"], capture_output=True,
                          text=True, timeout=120, env=_env(HF_FSDP2="1", PYTHONPATH=path))
    assert proc.returncode == 0 and proc.stdout.split() == ["1"], proc.stderr[-3000:]
    assert "RecursionError" not in proc.stderr


@pytest.mark.parametrize("first_import", ["import trl.models.utils", "from transformers import TrainingArguments"])
def test_it_registers_once_the_outermost_import_completes(first_import):
    """trl/models/utils.py imports accelerate, and transformers' training_args too: registering when accelerate's
    import completes would meet the half-made module (TRL: an AttributeError inside the user's import; the
    Trainer: its seams skipped). The switch waits for the outer import; the Trainer's seams go on as it loads."""
    probe = (f"{first_import}\nfrom transformers import Trainer\nfrom hf_fsdp2.runtime import upstream\n"
             "print(sorted(t for t in upstream.installed() if t.startswith(('transformers.T', 'accelerate.accelerator.f',"
             " 'trl'))))")
    proc = subprocess.run([PY, "-c", probe], capture_output=True, text=True, timeout=300,
                          env=_env(HF_FSDP2="1", PYTHONPATH=str(STARTUP)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    installed = eval(proc.stdout.strip().splitlines()[-1])
    assert "accelerate.accelerator.fsdp2_prepare_model" in installed
    assert {"transformers.Trainer.save_model", "transformers.TrainingArguments.__post_init__"} <= set(installed)
    assert ("trl.models.utils.prepare_fsdp" in installed) == first_import.startswith("import trl")
    assert proc.stderr.count("hf_fsdp2: registered at start-up") == 1, proc.stderr[-3000:]


def test_python_flags_that_turn_the_switch_off_are_named():
    """-I, -E and -S make Python ignore PYTHONPATH or site: hf-fsdp2 run warns when the command is such a Python."""
    for cmd in (["python", "-I", "x.py"], ["python3.11", "-bE", "-c", "pass"], ["/usr/bin/python3", "-W", "error",
                                                                                  "-S", "-m", "pip"]):
        assert _python_without_pythonpath(cmd), cmd
    for cmd in (["python", "x.py", "-I"], ["python", "-c", "-I"], ["python", "-m", "pip", "-E"], ["accelerate", "-I"],
                ["python", "-W", "I", "x.py"], ["python", "-X", "E"], ["python", "-XdevI"]):
        assert not _python_without_pythonpath(cmd), cmd
    proc = subprocess.run(SWITCH + [PY, "-I", "-c", "pass"], capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0 and "python -I ...: Python's -I, -E and -S ignore PYTHONPATH" in proc.stderr, proc.stderr


def test_a_registration_that_fails_at_start_up_is_said_where_the_import_is_swallowed(tmp_path):
    """A library's `try: import accelerate / except ImportError` (evaluate's and transformers' availability checks)
    would swallow register()'s error and leave the process silently unregistered: the switch says it on stderr
    first. Here an accelerate package without its modules makes register() fail."""
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "accelerate" / "__init__.py").write_text("")
    probe = "try:\n    import accelerate\nexcept ImportError:\n    print('swallowed')"
    proc = subprocess.run([PY, "-c", probe], capture_output=True, text=True, timeout=120,
                          env=_env(HF_FSDP2="1", PYTHONPATH=os.pathsep.join([str(STARTUP), str(tmp_path)])))
    assert proc.returncode == 0 and proc.stdout.split() == ["swallowed"], proc.stderr[-3000:]
    assert "hf_fsdp2: registration at start-up (hf-fsdp2 run) FAILED on importing accelerate" in proc.stderr, \
        proc.stderr[-3000:]
