"""sitecustomize for every process: a mark after each write to stdout, so a line written in pieces shows

Started by tests/lessons/test_examples.py."""

import sys


class Marked:
    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        return self.stream.write(text + "\x1e")

    def __getattr__(self, name):
        return getattr(self.stream, name)


sys.stdout = Marked(sys.stdout)
