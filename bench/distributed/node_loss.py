"""How long a lost node stalls an elastic job: from the node's death to the survivor's next
training step, for a node killed outright and for a node cut off the network.

    .venv/bin/python bench/distributed/node_loss.py  # bench/results/node_loss.json
    .venv/bin/python bench/distributed/node_loss.py --src OLD/src --label before --cap 120 \\
        --output bench/results/node_loss.before.json       # another dptrain's source tree

Two hosts made of network namespaces (bench/common/netns.py, needs root), one `dptrain train
--nnodes 1:2 --nproc 1` on each, the rendezvous on host a: a tiny TAGI MLP whose training
samples take 10 ms each to read (a step of 16 samples a rank takes ~0.2 s), a validation
point at every step (it prints `step N` and writes a checkpoint, so the survivor resumes at
the step it had reached). Once the job has trained a few steps on both hosts, host b is lost:

- **kill**: every process of host b (its agent and its rank) gets SIGKILL at once. The
  survivor's collective fails at once: the kernel closed b's sockets.
- **partition**: host b's link goes down. b's processes live on, but nothing reaches them and
  nothing from them arrives: no FIN, no RST, the survivor's collective just waits.

The time of each line of the survivor's output is when the bench first saw it (it polls the
log every 10 ms). From the loss to:

- `detected`: the survivor's agent says it restarts its worker (a failed worker, or a node
  whose rendezvous heartbeats stopped);
- `rendezvous`: torch's agent has a new round (its INFO log, `Rendezvous complete`);
- `started`: the new worker's process group is up (its `N process(es)` line);
- `resumed`: it has loaded the newest checkpoint (`resumed from`);
- `next_step`: its first training step is done (its `step N` line): the figure.

A case that has no next step within --cap seconds is recorded as not recovered, with the
lines it did reach.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import REPO, RESULTS as RESULTS_DIR, command_line, cpu_model  # noqa: E402
from common import netns as _netns  # noqa: E402

RESULTS = RESULTS_DIR / "node_loss.json"
CASES = ("kill", "partition")
PORT = 29471

PACED_DATA = """
import time
import torch
from dptrain.data import Split


class Rows(torch.utils.data.Dataset):
    def __init__(self, x, y, pace_s):
        self.x, self.y, self.pace_s = x, y, pace_s

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        time.sleep(self.pace_s)
        return self.x[i], self.y[i]


def load():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, 8, generator=g)
    y = torch.sin(x[:, :1]) + 0.1 * torch.randn(20000, 1, generator=g)
    return Split(name="paced", task="regression", num_classes=None,
                 train=Rows(x[:19968], y[:19968], 0.01),
                 validation=Rows(x[19968:19984], y[19968:19984], 0.0),
                 test=Rows(x[19984:], y[19984:], 0.0))
"""

MARKS = {  # phase -> what the survivor prints when it reaches it
    "detected": re.compile(r"restarting every worker|restarting this node's workers"),
    "rendezvous": re.compile(r"Rendezvous complete for workers"),
    "started": re.compile(r"dptrain train: .* \d+ process\(es\) \(torchrun"),
    "resumed": re.compile(r"^resumed from", re.M),
    "next_step": re.compile(r"^step \d+", re.M),
}


class TimedLog:
    """A node's output file, each new line stamped with when it was first seen."""

    def __init__(self, path: Path):
        self.path, self.lines, self._seen = path, [], 0

    def poll(self) -> None:
        text = self.path.read_text(errors="replace") if self.path.exists() else ""
        complete = text[:text.rfind("\n") + 1]
        now = time.monotonic()
        for line in complete[self._seen:].splitlines():
            self.lines.append((now, line))
        self._seen = len(complete)

    def first_after(self, since: float, pattern: re.Pattern) -> float | None:
        return next((t for t, line in self.lines if t >= since and pattern.search(line)), None)


def node_argv(host: _netns.Host, a: _netns.Host, args, data: Path, out: Path,
              case: str) -> list[str]:
    rdzv = ["--rdzv-conf", args.rdzv_conf] if args.rdzv_conf else []
    return host.cmd(
        sys.executable, "-m", "dptrain", "train", "--model", "tagi-mlp", "--hidden", "16",
        "--dataset", f"{data}:load", "--epochs", "1", "--batch-size", "32", "--val-every", "1",
        "--keep-last", "2", "--workers", "0", "--no-progress", "--nproc", "1",
        "--nnodes", "1:2", "--rdzv-endpoint", f"{a.name}:{PORT}", "--rdzv-id", f"lost-{case}",
        "--max-restarts", "3", "--out", str(out), *rdzv)


def node_env(src: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_",
                                "GLOO_", "NCCL_", "DPTRAIN_"))}
    # LOGLEVEL=INFO: torch's agent says when its rendezvous completes (the `rendezvous` mark).
    env.update(PYTHONPATH=str(src), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", LOGLEVEL="INFO")
    return env


def lose(case: str, b: _netns.Host) -> None:
    if case == "kill":
        pids = subprocess.run(["ip", "netns", "pids", b.ns], capture_output=True, text=True,
                              timeout=20).stdout.split()
        subprocess.run(["kill", "-9", *pids], capture_output=True, timeout=20)
    else:
        subprocess.run(b.cmd("ip", "link", "set", b.ifname, "down"), check=True, timeout=20)


def one_case(case: str, args, work: Path) -> dict:
    """Start the job on two fresh hosts, lose b after `--warmup` steps on both, time the
    survivor (a) to its next step."""
    pair = _netns.create()
    a, b = pair.hosts
    data = work / "paced.py"
    data.write_text(PACED_DATA)
    out = work / f"run-{case}-{time.time_ns()}"
    logs = [TimedLog(work / f"{case}-{h.name}.log") for h in pair.hosts]
    procs = []
    try:
        for host, log in zip(pair.hosts, logs, strict=True):
            with open(log.path, "w") as fp:
                procs.append(subprocess.Popen(node_argv(host, a, args, data, out, case),
                                              cwd=REPO, env=node_env(args.src), stdout=fp,
                                              stderr=subprocess.STDOUT))
        survivor = logs[0]
        deadline = time.monotonic() + 180
        steps_on_two = 0
        while steps_on_two < args.warmup:
            time.sleep(0.05)
            survivor.poll()
            two = [t for t, line in survivor.lines if " 2 process(es) (torchrun" in line]
            steps_on_two = sum(1 for t, line in survivor.lines
                               if two and t >= two[-1] and MARKS["next_step"].search(line))
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"the job did not train on two hosts\n"
                                   f"{survivor.path.read_text()}")
        lost_at = time.monotonic()
        lose(case, b)
        marks: dict[str, float | None] = {}
        while time.monotonic() - lost_at < args.cap:
            time.sleep(0.01)
            survivor.poll()
            since = lost_at
            for phase, pattern in MARKS.items():  # in order: each after the one before
                seen = survivor.first_after(since, pattern)
                if seen is None:
                    break
                marks[phase] = round(seen - lost_at, 2)
                since = seen
            if "next_step" in marks:
                break
        return {"case": case, "recovered": "next_step" in marks,
                "seconds_to_next_step": marks.get("next_step"), "marks_s": marks}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        _netns.destroy(pair)
        for p in procs:
            p.wait(timeout=20)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5,
                        help="steps on two hosts before b is lost")
    parser.add_argument("--cap", type=float, default=90.0,
                        help="seconds to wait for the survivor's next step")
    parser.add_argument("--rdzv-conf", default="", help="passed to dptrain train")
    parser.add_argument("--src", type=Path, default=REPO / "src",
                        help="the dptrain source tree the nodes run (default: this one)")
    parser.add_argument("--label", default="after")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    reason = _netns.unavailable_reason()
    if reason:
        print(f"node_loss: {reason}", file=sys.stderr)
        return 1
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    runs = []
    with tempfile.TemporaryDirectory(prefix="dptrain-lost-node-") as tmp:
        for repeat in range(args.repeats):
            for case in cases:
                run = one_case(case, args, Path(tmp))
                run["repeat"] = repeat
                print(json.dumps(run), flush=True)
                runs.append(run)
    summary = {}
    for case in cases:
        times = [r["seconds_to_next_step"] for r in runs if r["case"] == case and r["recovered"]]
        summary[case] = {
            "recovered": f"{len(times)}/{sum(r['case'] == case for r in runs)}",
            "median_s": round(statistics.median(times), 1) if times else None,
            "max_s": round(max(times), 1) if times else None}
    result = {"label": args.label, "cap_s": args.cap, "rdzv_conf": args.rdzv_conf,
              "summary": summary, "runs": runs,
              "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                          "python": platform.python_version(), "torch": torch.__version__},
              "command": command_line()}
    print(json.dumps({"label": args.label, "summary": summary}, indent=1))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
