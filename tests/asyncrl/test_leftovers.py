"""What a killed launcher left running is stopped by the next launch in its run dir (asyncrl/leftovers.py);
a reused pid and a launcher still running are never touched."""

import json
import subprocess

import psutil
import pytest

from asyncrl import leftovers


def test_the_recorded_processes_that_still_run_are_stopped_and_named(tmp_path):
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert leftovers.record(tmp_path) >= 1
        assert leftovers.stop_leftovers(tmp_path) == [f"sleep (pid {child.pid})"]
        assert child.wait(10) is not None and not (tmp_path / leftovers.RECORD).exists()
        assert leftovers.stop_leftovers(tmp_path) == []  # nothing recorded: nothing to say
    finally:
        child.kill()


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
