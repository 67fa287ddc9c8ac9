"""What a run keeps and what it starts from:

checkpoint.py   snapshot folders (DCP) and single files, written atomically and read back safely
train_state.py  the trainer's state into and out of a snapshot: step, schedule, random states, scaler
hf.py           Hugging Face GPT-2 folders, out (export.py --format hf) and in (--init_from)
"""
