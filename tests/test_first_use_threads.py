"""A Client's first calls from several threads at once: a call made while another thread is
still importing a module the client loads on first use (``kdn.client.staged``, by a first
``raw`` store on the server's host) is served as any, not an AttributeError about a
"partially initialized module"."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from kdn.server import ServerThread

_CHILD = """
import importlib.abc, importlib.machinery, sys, threading

from kdn.client import Client
from tests.helpers import numbered_key, random_kv, uniform_layout

assert "kdn.client.staged" not in sys.modules
importing, finish = threading.Event(), threading.Event()


class Held(importlib.abc.MetaPathFinder):
    # kdn.client.staged's import, held open between creating the module (it is in
    # sys.modules from then on) and running its body, as a slow import in another thread is
    def find_spec(self, name, path, target=None):
        if name != "kdn.client.staged":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        real = spec.loader

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return real.create_module(spec)

            def exec_module(self, module):
                importing.set()
                finish.wait(60)
                real.exec_module(module)

        spec.loader = Loader()
        return spec


sys.meta_path.insert(0, Held())
kv = random_kv(uniform_layout(), 16, seed=1)
with Client(sys.argv[1], timeout_s=30) as c:
    other = threading.Thread(target=lambda: __import__("kdn.client.staged"))
    other.start()
    assert importing.wait(30)
    try:
        c.store(numbered_key(1), kv)
        c.store_many([(numbered_key(2), kv)])
    finally:
        finish.set()
        other.join(30)
    assert c.retrieve(numbered_key(1)).equal(kv)
    assert c.retrieve(numbered_key(2)).equal(kv)
print("stored")
"""


def test_a_store_while_another_thread_imports_the_staged_module_is_served(
        server: ServerThread) -> None:
    """Such a store raised ``AttributeError: partially initialized module
    'kdn.client.staged' has no attribute 'Staged'`` (``sys.modules`` holds a module from
    the start of its import), seen once in three runs of 8 threads' first stores."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_CHILD), server.address],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["stored"]
