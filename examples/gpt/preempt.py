"""SIGTERM, what Slurm (scancel, preemption, --signal) and Kubernetes (eviction, deletion) send before
SIGKILL, and what torchrun forwards to its workers: the handler only notes it. The trainer reads the note
at its next step's check (guards.verdict, where every process learns whether any was asked), saves that
step's starting state and exits, so a resumed run goes on as if never stopped."""

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
