"""The GPT tests' fixture: one corpus cache for the whole session."""

import pytest
from helpers import session_dir


@pytest.fixture(scope="session")
def cache():
    """One corpus cache for the session, shared by the workers: the standard library corpus is built once,
    by the first process that needs it, while the others wait on the trainer's own lock (data.file_lock)."""
    return session_dir("gpt-cache")
