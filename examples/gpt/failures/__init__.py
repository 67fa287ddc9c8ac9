"""What goes wrong in a run, and what the trainer does then:

guards.py   the checks between backward and the optimizer step: non-finite losses and gradients
preempt.py  SIGTERM and Ctrl-C noted, so the next step that reads the checks saves and stops
failure.py  how a failed process ends: one line naming the cause, the exit status torchrun reports
hang.py     on a timeout every process dumps its stack and collectives (tools/why_hung.py reads them)
"""
