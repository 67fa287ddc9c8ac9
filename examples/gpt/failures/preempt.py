"""SIGTERM, what Slurm (scancel, preemption, --signal) and Kubernetes (eviction, deletion) send
before SIGKILL, and SIGINT, Ctrl-C; torchrun forwards both to its workers. The handler only
notes it. Every step's checks carry the note to every process (guards.verdict); at the next step
that reads them (a log, evaluation or save step: within --log_every steps) the trainer saves
that step's starting state and exits, so a resumed run goes on as if never stopped. A second
Ctrl-C stops at once, unsaved."""

import os
import signal

NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}


class StopRequest:
    """True once this process got SIGTERM or SIGINT; `name` says which."""

    def __init__(self):
        self.name = None
        for signum in NAMES:
            signal.signal(signum, self._note)

    def _note(self, signum, frame):
        self.name = NAMES[signum]
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # the next one: KeyboardInterrupt
            if os.environ.get("RANK", "0") == "0":  # unbuffered: print() may be writing when this runs
                os.write(2, b"Ctrl-C: saving at the next log step, then stopping (again: stop unsaved)\n")

    def __bool__(self):
        return self.name is not None

    def said(self, step, path):
        """The last line once saved: which stop (another
        process's, when this one got none) and where."""
        why = self.name or "a signal to another process"
        return f"stopped by {why} before step {step}, saved in {path}: the same command resumes"
