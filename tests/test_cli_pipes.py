"""A command whose stdout reader is gone (`fedhop run ... | head`) ends without a traceback: the
run it made is recorded whole, and the exit status says the pipe closed (141, 128 + SIGPIPE)."""
from __future__ import annotations

import sqlite3
import subprocess
import sys

CONFIG = """[run]
name = "pipe"
rounds = 2

[algorithm]
name = "fedavg"
lr = 0.1
local_steps = 1

[data]
dataset = "quadratic"
dim = 20

[clients]
count = 4
per_round = 4
processes = 1
"""


def test_a_run_whose_stdout_reader_left_is_recorded_and_says_so_in_one_status(tmp_path):
    (tmp_path / "run.toml").write_text(CONFIG)
    proc = subprocess.Popen([sys.executable, "-m", "fedhop.deploy.cli", "run", "run.toml", "--out", "r",
                             "--engine", "inprocess", "--quiet"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.close()   # the reader is gone before the command writes its first line
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 141, err.decode()[-2000:]
    assert b"Traceback" not in err
    con = sqlite3.connect(tmp_path / "r" / "run.db")
    try:
        assert con.execute("SELECT status FROM runs").fetchone()[0] == "completed"
        assert con.execute("SELECT COUNT(*) FROM rounds").fetchone()[0] == 2
    finally:
        con.close()


def test_a_broken_pipe_other_than_stdout_is_not_taken_for_a_closed_stdout(tmp_path):
    """A BrokenPipeError from another pipe (a child's, written to after the child ended) is a
    defect to show: it is raised as it is (a traceback, exit 1), not hidden as a closed stdout's
    141 that leaves the run unrecorded.  With stdout a file, which no reader can leave."""
    script = ("import sys\n"
              "from fedhop.deploy.cli import cli\n"
              "def main(argv):\n"
              "    raise BrokenPipeError(32, 'the pipe of a child process')\n"
              "cli.main = main\n"
              "sys.argv = ['fedhop', 'report']\n"
              "cli.entry()\n")
    with open(tmp_path / "out.txt", "wb") as out:
        proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, stdout=out, stderr=subprocess.PIPE,
                              timeout=120)
    assert proc.returncode == 1, proc.stderr.decode()
    assert b"BrokenPipeError" in proc.stderr and b"the pipe of a child process" in proc.stderr and b"Traceback" in proc.stderr
