"""The real launchers: `dptrain run` (torchrun's agent), torchrun itself, OpenMPI's mpirun.

Each run does a 2-rank all-reduce that every rank checks (examples/allreduce.py exits non-zero
on a wrong sum), so a pass means the rendezvous and the collective worked under that launcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._cli import PYTHON, REPO, base_env, dptrain_cmd, mpich_cmd, mpirun_cmd, run, stop

pytestmark = pytest.mark.e2e
EXAMPLE = str(REPO / "examples" / "allreduce.py")


def _assert_both_ranks_ok(result, launcher: str) -> None:
    assert result.returncode == 0, result.output
    for rank in (0, 1):
        assert f"rank {rank}/2 ({launcher}): all-reduce sum 3 ok" in result.stdout, result.output
    assert result.stdout.count("all 2 ranks agree") == 1, "only rank 0 prints the summary"


def test_dptrain_run_two_processes():
    _assert_both_ranks_ok(run(dptrain_cmd("run", "-n", "2", EXAMPLE), timeout_s=120), "torchrun")


def test_torchrun_directly():
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", EXAMPLE]
    _assert_both_ranks_ok(run(cmd, timeout_s=120), "torchrun")


def test_mpirun_two_processes_without_master_variables():
    """mpirun gives no rendezvous address: one node derives it from the job id."""
    result = run(mpirun_cmd(2, PYTHON, EXAMPLE), timeout_s=120)
    _assert_both_ranks_ok(result, "openmpi")


def test_mpich_mpiexec_two_processes_without_master_variables():
    """MPICH's Hydra sets PMI_RANK/PMI_SIZE; the ranks agree on a port through their shared
    parent (the node's proxy)."""
    _assert_both_ranks_ok(run(mpich_cmd(2, PYTHON, EXAMPLE), timeout_s=120), "mpich")


def test_a_raising_worker_stops_the_job_naming_the_rank():
    start = time.monotonic()
    result = run(dptrain_cmd("run", "-n", "2", EXAMPLE, "--fail-rank", "1"), timeout_s=120)
    assert result.returncode == 1
    assert "dptrain run: rank 1 failed first" in result.stderr
    assert "RuntimeError: rank 1 fails on purpose (--fail-rank)" in result.stderr
    assert time.monotonic() - start < 60


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def test_an_expected_error_in_the_workers_is_one_line_and_not_retried(tmp_path):
    """Both ranks raise CheckpointError (the run directory belongs to a run with other options,
    which only the workers can tell): the user sees one line with a rank, no traceback, the
    error's exit status (4), and no restart although restarts were allowed."""
    out = tmp_path / "r"
    first = run(dptrain_cmd("train", "--nproc", "1", "--epochs", "1", "--hidden", "16",
                            "--no-progress", "--out", str(out)), timeout_s=120)
    assert first.returncode == 0, first.output
    result = run(dptrain_cmd("train", "--epochs", "2", "--hidden", "8", "--no-progress",
                             "--out", str(out), "--max-restarts", "2"), timeout_s=120)
    assert result.returncode == 4, result.output
    lines = _error_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("dptrain train: error: rank ") and \
        "was started with different options: hidden 16 -> 8" in lines[0], lines
    assert "restarting" not in result.stderr


def test_an_expected_error_from_a_run_script_is_one_line_and_not_retried(tmp_path):
    """Restarts allowed, yet one attempt: the agent torch's launcher builds is still ours (we
    substitute it in torch.distributed.launcher.api, see dptrain.launcher.agent.using_agent)."""
    script, attempts = tmp_path / "bad.py", tmp_path / "attempts"
    script.write_text("import os, sys\nfrom dptrain.errors import ConfigError\n"
                      "open(sys.argv[1], 'a').write(os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    raise ConfigError('--widget must be positive, got -1')\n"
                      "import time; time.sleep(60)\n")
    result = run(dptrain_cmd("run", "-n", "2", "--max-restarts", "2", str(script),
                             str(attempts)), timeout_s=120)
    assert result.returncode == 2, result.output
    assert _error_lines(result.stderr) == \
        ["dptrain run: error: rank 1: --widget must be positive, got -1"], result.stderr
    # Rank 0 may be stopped before it writes; rank 1 writes before it raises.
    assert set(attempts.read_text()) == {"0"}, "an expected error was retried"


# Issue 21's race, made certain: in the first attempt rank 1 is mid-write of its error file
# (as when recording the RankFailure that rank 0's death causes) when rank 0 is SIGKILLed, so
# the agent stops rank 1 and reads a truncated file. The second attempt just finishes.
HALF_WRITTEN = """
import os, signal, sys, time
attempt, marker = os.environ["TORCHELASTIC_RESTART_COUNT"], sys.argv[1]
if attempt == "0" and os.environ["RANK"] == "1":
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as fp:
        fp.write('{"message": {"message": "RankFailure: rank 0 le')
        fp.flush()
        open(marker, "w").close()
        time.sleep(60)
if attempt == "0":
    deadline = time.monotonic() + 60
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)
# one write per line: the ranks share the job's stdout, unbuffered (print writes the text and
# its newline apart, so two ranks' lines could interleave)
sys.stdout.write(f"rank {os.environ['RANK']}: attempt {attempt} done\\n")
"""


def test_a_rank_stopped_while_writing_its_error_file_is_restarted_not_a_crash(tmp_path):
    script = tmp_path / "half_written.py"
    script.write_text(HALF_WRITTEN)
    result = run(dptrain_cmd("run", "-n", "2", "--max-restarts", "1", str(script),
                             str(tmp_path / "mid-write")), timeout_s=120)
    assert result.returncode == 0, result.output
    assert "dptrain run: rank 1 ended (exit code -15) while writing its error file " \
        in result.stderr, result.stderr
    assert "dptrain run: rank 0 failed (exit code -9, SIGKILL); restarting every worker (1 " \
        "restart(s) left)" in result.stderr, result.stderr
    assert sorted(line for line in result.stdout.splitlines() if "done" in line) == \
        ["rank 0: attempt 1 done", "rank 1: attempt 1 done"], result.output


SLEEPER = """
import os, sys, time
open(os.path.join(sys.argv[1], f"{os.getpid()}.pid"), "w").close()
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is not running.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_signal_stops_every_worker(tmp_path, sig):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    log = (tmp_path / "launcher.log").open("w")
    proc = subprocess.Popen(dptrain_cmd("run", "-n", "2", str(script), str(tmp_path)),
                            cwd=REPO, env=base_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 2:
            assert time.monotonic() < deadline, "workers did not start"
            assert proc.poll() is None, (tmp_path / "launcher.log").read_text()
            time.sleep(0.2)
        pids = [int(p.stem) for p in tmp_path.glob("*.pid")]
        proc.send_signal(sig)
        proc.wait(timeout=30)
        log.flush()
        output = (tmp_path / "launcher.log").read_text()
        # Quietly, with the shell's convention: 128 + the signal's number.
        assert proc.returncode == 128 + sig, output
        assert f"dptrain run: stopped by {sig.name}" in output
        assert "Traceback" not in output and "SignalException" not in output, output
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if _alive(p)], "orphaned workers"
    finally:
        stop(proc)
        log.close()


def test_python_dash_m_dptrain_works():
    result = run([sys.executable, "-m", "dptrain", "--version"], timeout_s=60)
    assert result.returncode == 0 and "dptrain 0.1.0" in result.stdout
