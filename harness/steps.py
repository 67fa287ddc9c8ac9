"""How each step of the tutorial is started: the one place that builds these commands.

    python harness/steps.py single_gpu -- 10 5                # python examples/single_gpu.py 10 5
    python harness/steps.py multinode --nproc 2 -- 10 5       # two local nodes of 2 processes each
    python harness/steps.py multigpu --dry-run -- 10 5        # print the command(s) only
    python harness/steps.py multigpu --vision -- 10 5         # on ResNet-18 (examples/vision.py)

The Makefile, benchmarks/lessons.py and the tests start the examples through `command()`. Only the standard
library is used, so that the host's python3 can start the steps inside a container too (--python
"docker run ... python"). multinode runs two "nodes" on this machine, each a torchrun through tools/launch.py,
meeting at a free localhost port; GPUs are split between them and each line of output is prefixed with
[node0]/[node1].
multigpu_ray runs on a Ray cluster of --nproc CPUs started for it and stopped after it (harness/ray_local.py).
"""

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading

# step name -> the example it runs and how it is started
STEPS = {
    "single_gpu": "python",
    "multigpu": "spawn",
    "multigpu_dataparallel": "python",  # one process, threads over every GPU
    "multigpu_torchrun": "torchrun",
    "multinode": "nodes",
    "multigpu_accelerate": "torchrun",
    "multigpu_ray": "ray",  # a Ray cluster on this machine for the run (harness/ray_local.py)
    "recipe": "torchrun",  # after step 3: the script to copy (digits, validation, bf16, resume on SIGTERM)
    "recipe_accelerate": "accelerate",  # the recipe in accelerate's idiom, by its one-node config
}
# torchrun's rendezvous gives up after these seconds, not its defaults of 600 and 60, when a node never comes
RDZV_CONF = "join_timeout=60,read_timeout=30"


def free_port():
    """A TCP port that nothing on this machine listens on now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def command(
    step, args=(), *, nproc=2, python=(sys.executable,), script=None, port=None, root="", vision=False
):
    """The command lines that start `step` with `nproc` processes (per node): one list per node.

    python: the interpreter, as a list (a container's, for example); root: the repository's folder, which
    the paths of examples/STEP.py and tools/launch.py are relative to (default: the working folder);
    script: another path for the example; port: multinode's rendezvous port (default: a free one);
    vision: the example run on ResNet-18 through examples/vision.py; a list: with vision.py's options.
    """
    if step not in STEPS:
        raise ValueError(f"unknown step {step!r}; steps: {', '.join(STEPS)}")
    scripts = [str(script or os.path.join(root, "examples", f"{step}.py"))]
    if vision is not False:
        options = [] if vision is True else [str(o) for o in vision]
        scripts[:0] = [os.path.join(root, "examples", "vision.py"), *options]
    args, python = [str(a) for a in args], list(python)
    how = STEPS[step]
    if how == "python":
        return [[*python, *scripts, *args]]
    if how == "spawn":
        return [[*python, *scripts, *args, "--nproc", str(nproc)]]
    if how == "ray":  # the head offers nproc CPUs: room for nproc workers on the CPU
        local = [*python, os.path.join(root, "harness", "ray_local.py"), f"--num-cpus={nproc}", "--"]
        return [[*local, *python, *scripts, *args, "--nproc", str(nproc)]]
    if how == "accelerate":  # accelerate launch, with the project's one-node config
        config = ["--config_file", os.path.join(root, "examples", "accelerate", "one_node.yaml")]
        launch = [*python, "-m", "accelerate.commands.launch", *config, "--num_processes", str(nproc)]
        return [[*launch, *scripts, *args]]
    procs = f"--nproc-per-node={nproc}"
    if how == "torchrun":
        return [[*python, "-m", "torch.distributed.run", "--standalone", procs, *scripts, *args]]
    port = port or free_port()
    rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", f"--rdzv-id=local{port}"]
    launch = [*python, os.path.join(root, "tools", "launch.py"), "--nnodes=2", procs, *rendezvous]
    return [[*launch, f"--rdzv-conf={RDZV_CONF}", *scripts, *args] for _ in range(2)]


def gpu_split(gpus, nodes):
    """CUDA_VISIBLE_DEVICES for each local node: the GPUs dealt out in equal blocks, or all CPU."""
    per = gpus // nodes
    return [",".join(map(str, range(n * per, (n + 1) * per))) for n in range(nodes)]


def relay(proc, prefix):
    for line in proc.stdout:
        sys.stdout.write(prefix + line)
        sys.stdout.flush()


def wait(procs):
    """Their exit statuses (128 + N for signal N), once all have ended. Ctrl-C reaches them from the terminal:
    this process waits for them to say so and end, with no traceback of its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # set after they started: they would inherit it
    codes = [proc.wait() for proc in procs]
    return [128 - code if code < 0 else code for code in codes]


def run(commands, gpus=0):
    """Run the command(s): one alone in the foreground, several side by side with prefixed output.
    Returns the first non-zero exit status, or 0."""
    # restarts (--max-restarts) need a fresh rendezvous store per round, not the agent's shared one
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if len(commands) == 1:
        omp = "OMP_NUM_THREADS=1 " if os.environ.get("OMP_NUM_THREADS") == "1" else ""
        print(f"{omp}{shlex.join(commands[0])}", flush=True)  # the command to copy (make hides its own)
        return wait([subprocess.Popen(commands[0], env=env)])[0]
    procs, threads = [], []
    for node, (cmd, devices) in enumerate(zip(commands, gpu_split(gpus, len(commands)), strict=True)):
        node_env = {**env, "CUDA_VISIBLE_DEVICES": devices} if gpus >= len(commands) else env
        print(f"[node{node}] {shlex.join(cmd)}", flush=True)
        proc = subprocess.Popen(
            cmd, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        procs.append(proc)
        threads.append(threading.Thread(target=relay, args=(proc, f"[node{node}] "), daemon=True))
        threads[-1].start()
    codes = wait(procs)
    for thread in threads:
        thread.join(timeout=10)
    return next((code for code in codes if code), 0)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], usage="%(prog)s STEP [options] -- ARGS"
    )
    parser.add_argument("step", choices=list(STEPS))
    parser.add_argument("--nproc", type=int, default=2, help="processes (per node for multinode)")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs on this machine, split between local nodes")
    parser.add_argument("--port", type=int, help="multinode's rendezvous port (default: a free one)")
    parser.add_argument("--python", default=sys.executable, help="interpreter command (default: this one)")
    parser.add_argument("--vision", action="store_true", help="on ResNet-18 (examples/vision.py)")
    parser.add_argument("--dry-run", action="store_true", help="print the command(s), run nothing")
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)  # after --: the example's own arguments
    args, example_args = parser.parse_args(argv[:split]), argv[split + 1 :]
    if args.nproc < 1:
        parser.error(f"--nproc must be positive, got {args.nproc}")
    if args.step == "multinode" and args.gpus >= 2:
        args.nproc = args.gpus // 2  # the GPUs split between the two local nodes
    if args.step != "single_gpu":
        # one thread a process where several share the cores: what torchrun sets, without its banner
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    python = shlex.split(args.python)
    commands = command(
        args.step, example_args, nproc=args.nproc, python=python, port=args.port, vision=args.vision
    )
    if args.dry_run:
        print("\n".join(shlex.join(cmd) for cmd in commands))
        return 0
    return run(commands, args.gpus)


if __name__ == "__main__":
    sys.exit(main())
