"""What a killed launcher left running is stopped by the next launch in its run dir (asyncrl_run/leftovers.py);
a reused pid and a launcher still running are never touched."""

import json
import subprocess
import sys

import psutil
import pytest

from asyncrl_run import leftovers
from tests.services import ROOT


LAUNCHER = """
import subprocess, sys, time
from pathlib import Path
from asyncrl_run import leftovers
from tests.services import ROOT
child = subprocess.Popen(["sleep", "60"], start_new_session=True)  # outlives its parent, as Ray's agents do
leftovers.record(Path(sys.argv[1]))
print(child.pid, flush=True)
time.sleep(60)
"""


def test_what_a_killed_launcher_left_running_is_stopped_and_named(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                                cwd=ROOT)
    left = psutil.Process(int(launcher.stdout.readline()))
    try:
        launcher.kill()
        launcher.wait(10)
        assert left.is_running()
        assert leftovers.stop_leftovers(tmp_path) == [f"sleep (pid {left.pid})"]
        assert not left.is_running() or left.status() == psutil.STATUS_ZOMBIE
        assert not (tmp_path / leftovers.RECORD).exists()
        assert leftovers.stop_leftovers(tmp_path) == []  # nothing recorded: nothing to say
    finally:
        if left.is_running():
            left.kill()


def test_a_pid_reused_by_another_process_is_left_alone(tmp_path):
    other = subprocess.Popen(["sleep", "60"])
    try:
        started = psutil.Process(other.pid).create_time()
        (tmp_path / leftovers.RECORD).write_text(json.dumps({
            "launcher": None, "children": [{"pid": other.pid, "started": started - 100, "name": "raylet"}]}))
        assert leftovers.stop_leftovers(tmp_path) == [] and other.poll() is None
    finally:
        other.kill()


def test_a_run_dir_whose_launcher_still_runs_is_refused(tmp_path):
    launcher = subprocess.Popen(["sleep", "60"])
    try:
        entry = {"pid": launcher.pid, "started": psutil.Process(launcher.pid).create_time(), "name": "python"}
        (tmp_path / leftovers.RECORD).write_text(json.dumps({"launcher": entry, "children": []}))
        with pytest.raises(RuntimeError, match=f"in use by a running launcher \\(pid {launcher.pid}\\)"):
            leftovers.stop_leftovers(tmp_path)
    finally:
        launcher.kill()
