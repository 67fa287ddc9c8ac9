"""Pitfall: snapshots on each node's own disk. In a multi-node run that resumes, every node must load the
same snapshot; when --snapshot_path is a local path, one node finds the last snapshot and another finds
none (or an older one), and they would train different models. multinode.py checks and stops.

python examples/pitfalls/node_local_snapshots.py [--fixed]    # --fixed: one folder both nodes share
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent  # the lessons this runs: single_gpu.py and multinode.py
LIMIT = 240  # seconds: every wait below shares one deadline (a busy machine needs minutes to start four)
END = time.monotonic() + LIMIT


def two_nodes(folders, snapshot):
    """multinode.py as two local nodes of one process each, each started in its own folder (its "disk")."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    rendezvous = [
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{port}",
    ]
    command = [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--rdzv-conf=join_timeout=30"]
    command += [str(EXAMPLES / "multinode.py"), "2", "1", "--snapshot_path", snapshot]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    nodes = [subprocess.Popen(command, cwd=f, env=env, **pipes) for f in folders]
    try:
        outputs = [node.communicate(timeout=max(END - time.monotonic(), 0.1))[0] for node in nodes]
    except subprocess.TimeoutExpired:  # a node that hangs: both killed with the workers they started
        for node in nodes:
            try:
                os.killpg(node.pid, signal.SIGKILL)
            except ProcessLookupError:  # that node had ended
                pass
        sys.exit(f"cause: the two nodes did not finish within {LIMIT} s and were killed")
    return [node.returncode for node in nodes], outputs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="apply the fix")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folders = [Path(tmp, "node0"), Path(tmp, "node1")]
        for folder in folders:
            folder.mkdir()
        # an earlier run left its snapshot (1 epoch) on node0's disk
        first = [sys.executable, str(EXAMPLES / "single_gpu.py"), "1", "1", "--snapshot_path", "snap.pt"]
        subprocess.run(first, cwd=folders[0], check=True, capture_output=True, timeout=END - time.monotonic())
        # the fix: a path every node sees (a shared file system or volume); here node0's folder, in full
        snapshot = str(folders[0] / "snap.pt") if args.fixed else "snap.pt"
        codes, outputs = two_nodes(folders, snapshot)
    for node, output in enumerate(outputs):
        for line in output.splitlines():
            if "snapshot" in line and ("ArgumentError" in line or "resuming" in line):
                print(f"seen: node{node}: {line.strip()}", flush=True)
    if any(codes):
        sys.exit(
            "cause: node-local snapshots: node0 found a snapshot at snap.pt and node1 none, so multinode.py "
            "stopped; fix: put --snapshot_path on storage every node shares (--fixed)"
        )
    print("fixed: both nodes resumed from the one shared snapshot and trained on", flush=True)


if __name__ == "__main__":
    main()
