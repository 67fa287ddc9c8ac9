"""A server that has imported torch and the GPT trainer once, and runs Python command lines for the GPT tests
by forking itself: each process that imports torch costs 2-3 CPU seconds on 2 cores, and the GPT tests start
about two hundred of them (tests/gpt/conftest.py starts one server for each pytest worker).

    python forkserver.py serve SOCKET          # the server: imports torch and the trainer, then listens
    python -I -S forkserver.py SCRIPT ARGS...  # as `python SCRIPT ARGS...`, run by the server at $FORKSERVER

The client sends its command line, folder, environment, stdin, stdout and stderr; the server forks, and the
child, in a session of its own, takes them and runs SCRIPT as __main__, as a new interpreter would. The
client stands in for it: the child's exit status (or signal) becomes its own, the signals it gets go to the
child's process group, and when the client dies (SIGKILL) the server kills that group. SOCKET.cpu holds the
CPU seconds of the runs that ended (tests/costs.py adds them to the tests that made them). What Python or
torch read from the environment when they start (PYTHON*, TORCH*, the thread and CUDA settings) is the
server's: tests/gpt/gpt_helpers.py sends only command lines whose environment agrees there, and runs the
others as they are."""

import json
import os
import select
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def become(request, fds, base_path, added):
    """This forked process as `python SCRIPT ARGS` in the client's folder, environment and stdio: runs
    SCRIPT as __main__ and never returns (its end, an exception included, ends the process as it would end
    Python's)."""
    import runpy
    import tempfile

    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in added.items():  # what the imports set where the environment had nothing (setdefault)
        os.environ.setdefault(key, value)
    tempfile.tempdir = None  # TMPDIR as the client has it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    script = request["argv"][0]  # as given, from the client's folder
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(os.path.abspath(script)), *extra, *base_path]
    sys.argv = list(request["argv"])
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def serve(path):
    base_path = sys.path[1:]  # the interpreter's own, without this file's folder
    gpt = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "gpt")
    sys.path.insert(0, os.path.normpath(gpt))
    before = dict(os.environ)
    import torch.distributed  # noqa: F401
    import train  # noqa: F401  (the trainer and all it imports)

    added = {key: value for key, value in os.environ.items() if key not in before}

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # there once it answers
    clients = {}  # connection -> the pid of its run
    cpu = 0.0  # CPU seconds of the runs that ended, and of the processes they waited for
    while True:
        readable, _, _ = select.select([listener, *clients], [], [], 0.05)
        for sock in readable:
            if sock is listener:
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    conn.close()
                    for other in clients:
                        other.close()
                    become(json.loads(message), fds, base_path, added)
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"{pid}\n".encode())
                clients[conn] = pid
            else:  # the client is gone before its run ended: the run goes too
                pid = clients.pop(sock)
                sock.close()
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        while True:  # the runs that ended: each one's status to its client, its CPU to the total
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            cpu += usage.ru_utime + usage.ru_stime
            with open(path + ".cpu.new", "w") as total:
                total.write(f"{cpu}\n")
            os.rename(path + ".cpu.new", path + ".cpu")
            for conn, run in list(clients.items()):
                if run == pid:
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                    del clients[conn]
                    conn.close()


def client(argv):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.environ["FORKSERVER"])
    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
    replies = sock.makefile("r")
    pid = int(replies.readline())
    for signum in FORWARDED:
        signal.signal(signum, lambda signum, frame: os.killpg(pid, signum))
    # SIGABRT too: a test that times out asks every Python process for its stacks (tests/helpers.py)
    signal.signal(signal.SIGABRT, lambda signum, frame: os.killpg(pid, signum))
    line = replies.readline()
    if not line.startswith("exit "):
        sys.exit(f"forkserver: the server ended before the run did: {line!r}")
    code = int(line.split()[1])
    if code < 0:  # ended by a signal: the same end here
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])
    else:
        client(sys.argv[1:])
