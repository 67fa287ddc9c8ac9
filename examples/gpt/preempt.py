"""SIGTERM, what Slurm (scancel, preemption, --signal) and Kubernetes (eviction, deletion) send before
SIGKILL, and what torchrun forwards to its workers: the handler only notes it. The trainer reads the note
at its next step's check (guards.verdict, where every process learns whether any was asked), saves that
step's starting state and exits, so a resumed run goes on as if never stopped."""

import signal


class StopRequest:
    def __init__(self, signals=(signal.SIGTERM,)):
        self.signal = None
        for sig in signals:
            signal.signal(sig, self._note)

    def _note(self, signum, frame):
        self.signal = signal.Signals(signum).name

    def __bool__(self):
        return self.signal is not None
