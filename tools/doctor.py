"""Check a machine for distributed training, ending with PASS or FAIL per check.

    make doctor                          # versions, GPUs, backends, network, a local all-reduce
    make doctor ENDPOINT=node0:29500     # also: can this machine reach that rendezvous endpoint?
    make doctor ENDPOINT=node0:29500 NODES=2   # on every node: they meet there and all-reduce together
    make doctor COLLECT_ENV=1            # also what an issue report asks for (torch.utils.collect_env)

Exit status 1 when a check fails.
"""

import argparse
import os
import platform
import shutil
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from launch import split_endpoint, store_answers  # tools/launch.py, beside this file
from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

results = []


def report(status, name, detail):
    results.append(status)
    print(f"{status:<5} {name:<12} {detail}", flush=True)


def versions():
    import accelerate

    cuda = torch.version.cuda or "none (CPU build)"
    nccl = "unused without CUDA"
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    report(
        "INFO",
        "versions",
        f"python {platform.python_version()}, torch {torch.__version__}, CUDA {cuda}, NCCL {nccl}, "
        f"accelerate {accelerate.__version__}",
    )


def gpus():
    count = torch.cuda.device_count()
    listed = ""
    if shutil.which("nvidia-smi"):
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES") == ""  # set and empty: every GPU hidden on purpose
    if not count and listed.strip() and not hidden:
        report(
            "FAIL",
            "gpus",
            f"nvidia-smi lists {len(listed.splitlines())} GPU(s), torch {torch.__version__} cannot use CUDA: "
            "is the driver new enough for its CUDA (13.0 needs driver 580 or newer)?",
        )
        return
    if not count:
        why = f"{len(listed.splitlines())} hidden by CUDA_VISIBLE_DEVICES=''" if listed.strip() else "none"
        report("INFO", "gpus", f"{why}: the examples use the CPU and gloo")
        return
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(count))
    report("INFO", "gpus", f"{count}: {names}")
    if shutil.which("nvidia-smi"):
        topology = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
        print(topology.stdout.rstrip())


def backends():
    available = {name: getattr(dist, f"is_{name}_available")() for name in ("gloo", "nccl", "mpi")}
    listed = ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in available.items())
    needed = "nccl" if torch.cuda.is_available() else "gloo"
    report("PASS" if available[needed] else "FAIL", "backends", f"{listed}; this machine needs {needed}")


def network():
    names = [name for _, name in socket.if_nameindex()]
    interfaces = ", ".join(names)
    if shutil.which("ip"):  # with iproute2, the IPv4 address of each interface too
        addresses = subprocess.run(["ip", "-brief", "-4", "addr"], capture_output=True, text=True, timeout=10)
        if addresses.returncode == 0:
            interfaces = "; ".join(" ".join(line.split()[::2]) for line in addresses.stdout.splitlines())
    report("INFO", "interfaces", interfaces)
    interface_variables(set(names))
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError as exc:
        report("FAIL", "hostname", f"{host} does not resolve ({exc}): add it to /etc/hosts")
        return
    if address.startswith("127.") and not os.environ.get("GLOO_SOCKET_IFNAME"):
        report(
            "INFO",
            "hostname",
            f"{host} resolves to {address}: fine on one machine; across machines set GLOO_SOCKET_IFNAME / "
            "NCCL_SOCKET_IFNAME to the interface the nodes share",
        )
    else:
        report("PASS", "hostname", f"{host} resolves to {address}")


def interface_variables(names):
    """GLOO_SOCKET_IFNAME (comma-separated names) and NCCL_SOCKET_IFNAME (name prefixes; =exact; ^ excludes)
    must name interfaces this machine has: gloo fails at the start, NCCL may hang or use another."""
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        value = os.environ.get(variable)
        if not value or value.startswith("^"):
            continue
        nccl = variable.startswith("NCCL")
        wanted = value.removeprefix("=").split(",")
        exact = not nccl or value.startswith("=")
        missing = [w for w in wanted if not any(n == w or (not exact and n.startswith(w)) for n in names)]
        if missing:
            have = ", ".join(sorted(names))
            detail = f"no interface {', '.join(missing)} on this machine (it has {have})"
            report("FAIL", "interface", f"{variable}={value}: {detail}; name one reaching the other nodes")
        else:
            report("PASS", "interface", f"{variable}={value} names an interface of this machine")


def route(host):
    """The interface this machine sends to `host` through (ip route get): the one to name in
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME when they pick another."""
    try:
        address = socket.gethostbyname(host)
        out = subprocess.run(["ip", "route", "get", address], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return
    words = out.stdout.split()
    if out.returncode == 0 and "dev" in words:
        device = words[words.index("dev") + 1]
        via = f"through interface {device}: GLOO_SOCKET_IFNAME={device}"
        report("INFO", "route", f"to {host} ({address}) {via}")


def endpoint(value, seconds):
    """Run before node 0's job (a pre-flight), nothing listens at ENDPOINT yet: what can be checked then is
    the name, the route and that the host refuses the port (it is reachable) rather than staying silent;
    once node 0's job runs, that a torch rendezvous store answers there."""
    try:
        host, port = split_endpoint(value)
    except ValueError as exc:
        report("FAIL", "endpoint", f"{value}: the port is not a number ({exc})")
        return
    try:
        address = socket.gethostbyname(host)
    except OSError as exc:
        report("FAIL", "endpoint", f"{host} does not resolve ({exc}): use node 0's name or address")
        return
    report("PASS", "endpoint", f"{host} resolves to {address}")
    route(host)
    try:
        socket.create_connection((address, port), timeout=2).close()
    except ConnectionRefusedError:
        report(
            "INFO",
            "endpoint",
            f"{address} refuses port {port}: it is reachable and nothing listens there yet, as expected "
            "until node 0's job starts (it opens the port). Once it runs, run this again: then the store "
            "must answer",
        )
        return
    except OSError as exc:
        report(
            "FAIL",
            "endpoint",
            f"no answer from {address} port {port} within 2 s ({exc}): a firewall drops the connection, the "
            "address is not node 0's, or a container network does not reach that host",
        )
        return
    start = time.monotonic()
    answer = store_answers(host, port, seconds)
    if answer is True:
        report(
            "PASS",
            "endpoint",
            f"a torch rendezvous store answered at {value} in {time.monotonic() - start:.3f} s",
        )
    elif answer is False:
        report(
            "FAIL",
            "endpoint",
            f"{value} accepts connections but does not answer as a torch rendezvous store within "
            f"{seconds:g} s: another program holds that port (torchrun would wait on it forever)",
        )
    else:
        report(
            "FAIL",
            "endpoint",
            f"no rendezvous store answers at {value}: it accepted a connection, then refused or reset the "
            "store's. Usual causes: node 0's job was stopping, or another program holds the port",
        )


def bus_bandwidth(size, seconds, world_size):
    """GB/s an all-reduce of `size` bytes moved per link (nccl-tests' busbw): 2(n-1)/n of it each way."""
    return size / seconds * 2 * (world_size - 1) / world_size / 1e9


def shared_memory():
    """/dev/shm holds NCCL's buffers between the GPUs of a machine; containers get 64 MB unless told."""
    in_container = os.path.exists("/.dockerenv") or "KUBERNETES_SERVICE_HOST" in os.environ
    if not in_container or not os.path.isdir("/dev/shm"):
        return
    size = shutil.disk_usage("/dev/shm").total
    if size < 2**30:
        fix = "docker run --shm-size 8g, compose's shm_size, or a memory emptyDir at /dev/shm on Kubernetes"
        report(
            "FAIL",
            "shm",
            f"/dev/shm is {size / 2**20:.0f} MB in this container: NCCL fails with "
            f"'unhandled system error'; {fix}",
        )
    else:
        report("PASS", "shm", f"/dev/shm is {size / 2**30:.1f} GB in this container")


def gloo_address():
    """The address gloo offers the other nodes, and the interface that holds it."""
    name = os.environ.get("GLOO_SOCKET_IFNAME")
    if name:
        return f"interface {name} (GLOO_SOCKET_IFNAME)"
    try:
        return f"{socket.gethostbyname(socket.gethostname())}, the address of this machine's name"
    except OSError:
        return "no address: this machine's name does not resolve"


def across_nodes(value, nodes, seconds):
    """Run on every node with the same ENDPOINT: the nodes meet there as torchrun's c10d rendezvous has them
    meet, then all-reduce 64 MB across the nodes with gloo (and NCCL, one GPU a node, where there are GPUs).
    A failure names what the nodes got to and the usual causes."""
    try:
        host, port = split_endpoint(value)
    except ValueError as exc:
        report("FAIL", "nodes", f"{value}: the port is not a number ({exc})")
        return
    wait = {"join_timeout": int(seconds), "read_timeout": int(seconds)}
    params = RendezvousParameters("c10d", f"{host}:{port}", "doctor", nodes, nodes, **wait)
    start = time.monotonic()
    try:
        info = get_rendezvous_handler(params).next_rendezvous()
    except RendezvousError as exc:
        report(
            "FAIL",
            "nodes",
            f"{nodes} nodes did not meet at {value} within {seconds:g} s "
            f"({type(exc).__name__}): start this on every node, with the same ENDPOINT and NODES",
        )
        return
    report(
        "PASS",
        "nodes",
        f"{nodes} nodes met at {value} in {time.monotonic() - start:.1f} s: this is node {info.rank}",
    )
    # gloo's connections between the nodes can outlast any timeout given to torch (a firewall that drops
    # them: about 100 s of connect retries): the collectives run in a thread, waited for `seconds`
    outcome = []
    worker = threading.Thread(target=nodes_all_reduce, args=(info, nodes, seconds, outcome), daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        outcome.append(f"did not finish within {seconds:g} s")
    if not outcome:
        outcome.append("ended without a result")
    for line in list(outcome):
        if line.startswith(("gloo", "nccl")):
            report("PASS", "nodes", f"{line}; this node offered {gloo_address()}")
            continue
        report(
            "FAIL",
            "nodes",
            f"the nodes met at {value}, but the all-reduce across them {line}. Usual causes: the nodes "
            "connect to each other on ports of their own, beyond the endpoint's, which a firewall may "
            "drop; GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME naming an interface the others cannot reach "
            f"(this node offered {gloo_address()}); with NCCL on GPUs without peer-to-peer support, "
            "NCCL_P2P_DISABLE=1",
        )


def nodes_all_reduce(info, nodes, seconds, outcome):
    """64 MB all-reduced across the nodes, gloo then NCCL (one GPU a node); a line each in outcome."""
    timeout = timedelta(seconds=seconds)
    backends = ["gloo", "nccl"] if torch.cuda.is_available() else ["gloo"]
    try:
        # gloo connects the nodes to each other here
        dist.init_process_group("gloo", store=info.store, rank=info.rank, world_size=nodes, timeout=timeout)
        for backend in backends:
            group = dist.new_group(backend=backend, timeout=timeout)
            device = "cuda" if backend == "nccl" else "cpu"
            tensor = torch.ones(16 * 2**20, device=device)
            dist.all_reduce(tensor, group=group)  # warm-up: NCCL connects here
            start = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            if device == "cuda":
                torch.cuda.synchronize()
            took = time.perf_counter() - start
            busbw = bus_bandwidth(tensor.numel() * 4, took, nodes)
            if not bool((tensor == nodes**2).all()):
                raise RuntimeError(f"the sum is {tensor[0].item()}, not {nodes**2}")
            speed = f"{took * 1e3:.0f} ms, busbw {busbw:.2f} GB/s"
            outcome.append(f"{backend} all-reduce of 64 MB across {nodes} nodes: {speed}")
        dist.destroy_process_group()
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        outcome.append(f"failed: {first}")


def all_reduce_worker(rank, world_size, port, numel):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    use_cuda = torch.cuda.device_count() >= world_size  # one process per GPU, as in training
    if use_cuda:
        torch.cuda.set_device(rank)
    backend = "nccl" if use_cuda else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    tensor = torch.full((numel,), float(rank + 1), device="cuda" if use_cuda else "cpu")
    dist.all_reduce(tensor)  # warm-up, and the value to check
    expected = world_size * (world_size + 1) / 2
    if not bool((tensor == expected).all()):
        raise SystemExit(f"all-reduce gave {tensor[0].item()}, expected {expected}")
    start = time.perf_counter()
    dist.all_reduce(tensor)
    if use_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if rank == 0:
        busbw = bus_bandwidth(numel * 4, seconds, world_size)
        size = f"{numel * 4 / 1e6:.0f} MB"
        print(f"{backend}, {world_size} processes, {size}: {seconds * 1e3:.1f} ms, busbw {busbw:.2f} GB/s")
    dist.destroy_process_group()


def all_reduce(seconds):
    gpu_count = torch.cuda.device_count()
    world_size = 2  # an all-reduce within one process would exchange nothing
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker_args = (world_size, port, 4 * 2**20)
    context = mp.start_processes(all_reduce_worker, worker_args, world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + seconds
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                report("FAIL", "all-reduce", f"{world_size} processes did not finish within {seconds:g} s")
                return
    except mp.ProcessException as exc:
        report("FAIL", "all-reduce", f"{exc}".strip().splitlines()[-1])
        return
    backend = "nccl" if gpu_count >= world_size else "gloo on the CPU"
    report("PASS", "all-reduce", f"{world_size} local processes agree on the sum ({backend})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", help="HOST:PORT of a rendezvous to try to reach")
    parser.add_argument("--timeout", type=float, default=120, help="seconds for the all-reduce (default 120)")
    parser.add_argument("--nodes", type=int, help="meet this many nodes at --endpoint and all-reduce")
    parser.add_argument("--collect_env", action="store_true", help="end with torch.utils.collect_env")
    args = parser.parse_args()
    if args.endpoint and ":" not in args.endpoint:
        parser.error(f"--endpoint must be HOST:PORT, got {args.endpoint}")
    if args.nodes is not None and (args.nodes < 2 or not args.endpoint):
        parser.error("--nodes needs --endpoint HOST:PORT and at least 2 nodes")
    if args.timeout < 1:
        parser.error(f"--timeout must be at least 1 second, got {args.timeout:g}")
    versions()
    gpus()
    backends()
    network()
    shared_memory()
    if args.endpoint and args.nodes:
        across_nodes(args.endpoint, args.nodes, args.timeout)
    elif args.endpoint:
        endpoint(args.endpoint, min(args.timeout, 10))
    all_reduce(args.timeout)
    failed, checked = results.count("FAIL"), len(results) - results.count("INFO")
    print(f"doctor: {failed} of {checked} checks FAILED" if failed else f"doctor: all {checked} checks pass")
    if args.collect_env:
        from torch.utils.collect_env import get_pretty_env_info

        print(f"\ntorch.utils.collect_env, for an issue report:\n{get_pretty_env_info()}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
