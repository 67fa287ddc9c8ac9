"""SIGTERM, what Slurm (scancel, preemption, --signal) and Kubernetes (eviction, deletion) send before
SIGKILL, and what torchrun forwards to its workers: the handler only notes it. Every step's checks carry
the note to every process (guards.verdict); at the next step that reads them (a log, evaluation or save
step: within --log_every steps) the trainer saves that step's starting state and exits, so a resumed run
goes on as if never stopped."""

import signal


class StopRequest:
    """True once this process got SIGTERM."""

    def __init__(self):
        self.asked = False
        signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum, frame):
        self.asked = True

    def __bool__(self):
        return self.asked
