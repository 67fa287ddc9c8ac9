"""What a run shows of itself:

metrics.py  the log, JSON lines and TensorBoard scalars; each process's pace, to name the slow ones
memory.py   bytes per process: parameters, gradients, optimizer state, peak; a memory history
traces.py   profiler traces of chosen steps, and their compute and collective breakdown
"""
