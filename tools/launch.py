"""torchrun, plus an explanation when the nodes cannot meet.

    python tools/launch.py --nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=node0:29500 ... train.py ARGS

Takes torchrun's arguments and runs torchrun (torch.distributed.run) unchanged. When its rendezvous fails,
it ends with status 1 and, in place of torchrun's traceback, what failed, at which host:port, after how
long, and the usual causes. `make multinode`, the compose files and the Kubernetes manifests (k8s/) launch
through it. Before torchrun starts, it waits, at most read_timeout, until the endpoint's host name resolves:
a Kubernetes pod's DNS name appears a few seconds after the pod starts, and torchrun decides whether it hosts
the store by resolving it once. A refusal of the command line (exit status 2, argparse's) is not retried
under --max-restarts: every attempt would refuse alike.
"""

import socket
import sys
import threading
import time
from datetime import timedelta

from torch.distributed import TCPStore
from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousTimeoutError,
)
from torch.distributed.run import main as torchrun
from torch.distributed.run import parse_args

# torchrun's defaults, for the message when --rdzv-conf does not set them
JOIN_TIMEOUT, READ_TIMEOUT = 600, 60
# argparse's exit status for a command line it refuses: a restart would refuse it again
USAGE_ERROR = 2


def refusals_end_the_run(agent_class):
    """The agent gives up when its workers' first failure (torchrun's "root cause") exited with USAGE_ERROR,
    whatever restarts are left; every other failure is restarted as before."""
    monitor = agent_class._monitor_workers

    def _monitor_workers(self, worker_group):
        result = monitor(self, worker_group)
        if result.state == WorkerState.FAILED and result.failures:
            first = min(result.failures.values(), key=lambda failure: failure.timestamp)
            if first.exitcode == USAGE_ERROR and self._remaining_restarts > 0:
                print("a worker refused its command line (exit 2): not restarted", file=sys.stderr)
                self._remaining_restarts = 0
        return result

    agent_class._monitor_workers = _monitor_workers


def rdzv_conf(text):
    """--rdzv-conf's key=value,key=value pairs as a dict."""
    return dict(item.split("=", 1) for item in text.split(",") if "=" in item)


def split_endpoint(endpoint):
    """HOST:PORT as (host, port); torchrun's c10d default port when there is none."""
    host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "29400")
    return host, int(port)


def store_answers(host, port, seconds=10):
    """True when a torch TCPStore answers at host:port; False when a program accepts the connection and
    then stays silent for `seconds` (where torchrun would wait forever); None when nothing accepts a
    connection within 2 s, or the connection is refused or reset."""
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError:
        return None
    outcome = []

    def probe():
        try:
            TCPStore(host, port, is_master=False, timeout=timedelta(seconds=seconds))
            outcome.append(True)
        except Exception:  # refused or reset: torchrun reports that itself, within its bounds
            outcome.append(None)

    thread = threading.Thread(target=probe, daemon=True)  # a silent program never lets it return
    thread.start()
    thread.join(seconds)
    return outcome[0] if outcome else False


def wait_for_name(endpoint, seconds):
    """Returns once the endpoint's host name resolves; ends the run when it has not within `seconds`."""
    host, _ = split_endpoint(endpoint)
    deadline, said = time.monotonic() + seconds, False
    while True:
        try:
            socket.getaddrinfo(host, None)
            return
        except (socket.gaierror, UnicodeError) as exc:
            if time.monotonic() >= deadline:
                sys.exit(
                    f"error: the rendezvous host {host} did not resolve within read_timeout ({seconds:g} s): "
                    f"{exc}.\nUsual causes: a misspelt host name in --rdzv-endpoint, the first node not "
                    "started (a container's or pod's name exists only while it runs), or no DNS server.\n"
                    f"Check the endpoint from every node: python tools/doctor.py --endpoint {endpoint}"
                )
            if not said:
                print(f"waiting up to {seconds:g} s for the rendezvous host {host} to resolve", flush=True)
                said = True
            time.sleep(1)


def check_port(endpoint, seconds=10):
    """Ends the run when a program that is not a rendezvous store holds the endpoint's port: torchrun would
    connect to it and wait for an answer that never comes, past every timeout."""
    host, port = split_endpoint(endpoint)
    if store_answers(host, port, seconds) is False:
        sys.exit(
            f"error: port {port} on {host} is already in use by a program that is not a torch rendezvous "
            f"store (no answer within {seconds} s). Stop that program or choose another port, the same on "
            f"every node: --rdzv-endpoint={host}:ANOTHER_PORT"
        )


def explain(args, exc):
    conf = rdzv_conf(args.rdzv_conf)
    where, name = args.rdzv_endpoint, type(exc).__name__
    check = f"Check the endpoint from every node: python tools/doctor.py --endpoint {where}"
    if isinstance(exc, RendezvousConnectionError):
        return (
            f"error ({name}): could not reach the rendezvous store at {where} within read_timeout "
            f"({conf.get('read_timeout', READ_TIMEOUT)} s).\n"
            "Usual causes: the host is not the first node (whose torchrun hosts the store), that node is "
            "not started yet or failed (see its log), a firewall blocks the port, the port is taken by "
            "another program there, or a container network that does not reach that address.\n" + check
        )
    if isinstance(exc, RendezvousTimeoutError):
        return (
            f"error ({name}): not all {args.nnodes} node(s) joined the rendezvous at {where} within "
            f"join_timeout ({conf.get('join_timeout', JOIN_TIMEOUT)} s).\n"
            "Usual causes: a node was not started, was started with another --rdzv-endpoint or --rdzv-id, "
            "or failed before joining (see its log); after a failure, a node that did not come back in "
            "time.\nStart every node, within join_timeout of the first, with the same rendezvous: torchrun "
            f"--nnodes={args.nnodes} --rdzv-backend=c10d --rdzv-endpoint={where} --rdzv-id={args.rdzv_id} "
            "...\n" + check
        )
    if isinstance(exc, RendezvousClosedError):
        return (
            f"error ({name}): the rendezvous at {where} was closed: another node ended the job (see its log)."
        )
    return f"error ({name}): the rendezvous at {where} failed: {exc}\n" + check


if __name__ == "__main__":
    refusals_end_the_run(LocalElasticAgent)
    args = parse_args(sys.argv[1:])
    if args.rdzv_backend == "c10d" and not args.standalone:
        wait_for_name(args.rdzv_endpoint, float(rdzv_conf(args.rdzv_conf).get("read_timeout", READ_TIMEOUT)))
        check_port(args.rdzv_endpoint)
    try:
        torchrun(sys.argv[1:])
    except RendezvousError as exc:
        sys.exit(explain(args, exc))
